"""The DHT process's request pipe.

Here, with cotrain processes; the rest in tests/swarm/test_dht.py and tests/unit/hivemind_ext/test_dht.py."""

import pytest

from support.dht import _daemons_of, _own_daemons

SERVE_DHT = """
import sys, time
from cotrain.net.dht import create_dht, visible_maddrs
dht = create_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
print(visible_maddrs(dht)[0], flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stopped", ["dht", "daemon"])
def test_a_newcomer_tries_again_when_its_initial_peer_is_too_busy_to_answer(caplog, stopped):
    import signal
    import subprocess
    import sys
    import threading

    from cotrain.net.dht import create_dht

    busy = subprocess.Popen([sys.executable, "-c", SERVE_DHT], stdout=subprocess.PIPE, text=True)
    target = busy
    try:
        address = busy.stdout.readline().strip()
        # dht: its daemon accepts connections, its DHT answers nothing; daemon: the daemon itself does not
        # finish a connection's handshake (the kernel accepts it), as on a machine loaded far past its cores
        target = busy if stopped == "dht" else _daemons_of(busy.pid)[0]
        target.send_signal(signal.SIGSTOP)
        woken = threading.Timer(14.0, target.send_signal, args=(signal.SIGCONT,))
        woken.start()
        with caplog.at_level("WARNING", logger="cotrain.net.dht"):
            dht = create_dht(initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"], wait_timeout=5.0)
        try:
            assert "trying again (try 2, " in caplog.text
            assert dht.get("nothing here") is None  # it works
            assert len(_own_daemons()) == 1  # the failed tries' daemons have exited
        finally:
            dht.shutdown()
            woken.join()
    finally:
        target.send_signal(signal.SIGCONT)
        busy.kill()
        busy.wait()
