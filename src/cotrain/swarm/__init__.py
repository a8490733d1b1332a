"""The thin layer over hivemind: the DHT, signed records and the collaborative optimizer."""
