"""The peers a swarm is made of: trainer, monitor. Each is a class with run() and close()."""
