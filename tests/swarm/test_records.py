"""Signed metrics records.

Here, with hivemind in the test process; the rest in tests/unit/net/test_records.py."""

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from cotrain.keys import metrics_key
from cotrain.net.metrics import MetricsSchema, read_metrics
from support.records import good

LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]


def _validators(run_id: str, key: RSAPrivateKey):
    signer = RSASignatureValidator(key)
    return [SchemaValidator(MetricsSchema, prefix=run_id), signer], signer.local_public_key


@pytest.mark.timeout(60)
def test_live_dht_refuses_forged_and_out_of_schema_records():
    run_id = "records-test"
    v1, key1 = _validators(run_id, RSAPrivateKey())
    v2, key2 = _validators(run_id, RSAPrivateKey())
    dht1 = hivemind.DHT(host_maddrs=LOCALHOST, record_validators=v1, nat_port_map=False, start=True)
    dht2 = hivemind.DHT(
        initial_peers=[str(a) for a in dht1.get_visible_maddrs()],
        host_maddrs=LOCALHOST,
        record_validators=v2,
        nat_port_map=False,
        start=True,
    )
    try:
        expiration = get_dht_time() + 60
        key = metrics_key(run_id)
        # peer 2 writes its own record: accepted
        assert dht2.store(key, good(step=5), expiration, subkey=key2)
        # peer 2 tries to write under peer 1's key (a forgery): refused
        assert not dht2.store(key, good(step=99, loss=0.0), expiration, subkey=key1)
        # an absurd value, even under its own key: refused by the schema
        bad = {**good(), "samples_per_second": 1e12}
        assert not dht2.store(key, bad, expiration, subkey=key2)
        # an unsigned subkey: refused
        assert not dht2.store(key, good(), expiration, subkey=b"anyone")
        seen = read_metrics(dht1, run_id)
        assert list(seen) == [key2] and seen[key2].step == 5
    finally:
        dht2.shutdown()
        dht1.shutdown()


def test_keys_are_spelled_as_hivemind_derives_them(monkeypatch):
    """cotrain.keys names the keys hivemind builds from the run id; hivemind's own code agrees."""
    from types import SimpleNamespace

    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.optim import optimizer as hivemind_optimizer
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils.serializer import MSGPackSerializer

    from cotrain import keys
    from cotrain.net.configrecord import ConfigSchema, RunsSchema
    from cotrain.net.metrics import EvalSchema

    run = "keys-test"
    # a schema validator guards exactly ``{prefix}_{field}``: junk is refused there and nowhere else
    junk = MSGPackSerializer.dumps("junk")
    for schema, key, prefix in [
        (MetricsSchema, keys.metrics_key(run), run),
        (EvalSchema, keys.eval_key(run), run),
        (ConfigSchema, keys.config_key(run), run),
        (RunsSchema, keys.runs_key(), None),
    ]:
        validator = SchemaValidator(schema, prefix=prefix)
        assert not validator.validate(DHTRecord(DHTID.generate(source=key).to_bytes(), b"", junk, 1e12)), key
        other = DHTID.generate(source=f"{key}_other").to_bytes()
        assert validator.validate(DHTRecord(other, b"", junk, 1e12))
    # hivemind's ProgressTracker reads its records under progress_key(run)
    read = []
    dht = SimpleNamespace(
        client_mode=True,
        peer_id=SimpleNamespace(to_bytes=lambda: b"peer"),
        add_validators=lambda v: None,
        get=lambda k, latest: read.append(k),
    )
    tracker = ProgressTracker(dht, run, target_batch_size=1, start=False)
    assert tracker.training_progress_key == keys.progress_key(run) and read == [keys.progress_key(run)]
    # hivemind.Optimizer names its averagers from its run id
    made = {}
    monkeypatch.setattr(
        hivemind_optimizer, "TrainingStateAverager", lambda **kw: made.setdefault("state", kw)
    )
    fields = "matchmaking_time allreduce_timeout shutdown_timeout offload_optimizer status_loglevel"
    optimizer = SimpleNamespace(
        run_id=run, dht=None, client_mode=True, auxiliary=False, next_chunk_timeout=1.0
    )
    optimizer.__dict__.update(dict.fromkeys(fields.split()))
    hivemind.Optimizer._make_state_averager(optimizer)
    optimizer.state_averager = SimpleNamespace(main_parameters=[])
    hivemind.Optimizer._make_gradient_averager(optimizer, lambda **kw: made.setdefault("grad", kw))
    assert made["state"]["prefix"] == keys.state_averager_prefix(run)
    assert made["grad"]["prefix"] == keys.grad_averager_prefix(run)
