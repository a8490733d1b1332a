"""The address is the trust anchor.

Here, with cotrain processes; the rest in tests/swarm/test_trust_anchor.py and
tests/unit/net/test_trust_anchor.py."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from conftest import FAST, LOCALHOST, Role, monitor_address, monitor_args, trainer_args, wait_until
from cotrain.net.configrecord import ConfigPublisher, make_record, read_configs, schema_validators

SYBIL_LR = 0.0123


def publish_sybils(address: list[str], run_id: str, n: int = 3) -> list[hivemind.DHT]:
    """``n`` DHT peers, each with an RSA key of its own, publishing the monitor's config with another
    learning rate under the run's config key: more records than the monitor's."""
    dhts: list[hivemind.DHT] = []
    for _ in range(n):
        signer = RSASignatureValidator(RSAPrivateKey())
        dht = hivemind.DHT(
            initial_peers=address,
            host_maddrs=[LOCALHOST],
            record_validators=[*schema_validators(run_id), signer],
            nat_port_map=False,
            start=True,
        )
        dhts.append(dht)
        monitors = wait_until(lambda d=dht: read_configs(d, run_id), 20, what="the monitor's config record")
        fields = {**next(iter(monitors.values())).fields(), "learning_rate": SYBIL_LR}
        record = make_record(fields, "trainer", peer_id=str(dht.peer_id))
        ConfigPublisher(dht, run_id, signer.local_public_key, record).publish()
    wait_until(lambda: len(read_configs(dhts[0], run_id)) >= n + 1, 20, what="the sybils' records")
    return dhts


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_newcomer_takes_the_settings_of_the_address_it_was_given_not_of_the_most_keys(demo_data, tmp_path):
    run_id = "anchor-live"
    common = ["--preset", "albert-tiny", "--run-id", run_id, "--host-maddrs", LOCALHOST, *FAST]
    monitor = Role(monitor_args(common, tmp_path / "monitor"), tmp_path / "monitor.log")
    roles, sybils = [monitor], []
    try:
        address = monitor_address(tmp_path / "monitor", 90)
        sybils = publish_sybils(address, run_id)
        newcomer_args = trainer_args(
            ["--run-id", run_id, "--host-maddrs", LOCALHOST, *FAST], address, demo_data, 1, tmp_path / "new"
        )
        newcomer = Role(newcomer_args, tmp_path / "new.log")
        roles.append(newcomer)
        wait_until(
            lambda: "Taking the settings of run" in newcomer.text(),
            60,
            what="the newcomer taking the run's settings",
        )
        text = newcomer.text()
        monitor_id = address[0].split("/p2p/")[-1]
        assert (
            f"Taking the settings of run {run_id!r} from initial peer {monitor_id}: preset albert-tiny"
            in text
        )
        # the peer wrote its config.toml at its start and writes it again with the settings it took
        written = tmp_path / "new" / "config.toml"
        wait_until(lambda: 'preset = "albert-tiny"' in _read(written), 30, what="the taken config")
        config = _read(written)
        assert str(SYBIL_LR) not in config, config
        # its config is then checked against the DHT's majority (the sybils' records), which refuses it: many
        # keys can still keep a newcomer out, not make it train with their settings
    finally:
        for dht in sybils:
            dht.shutdown()
        for role in roles:
            role.stop()


def _read(path) -> str:
    return path.read_text() if path.exists() else ""
