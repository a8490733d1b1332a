"""The cap on a state download (cotrain.swarm.statelimit): a donor's stream is counted against the state the
downloader holds itself; one that sends more tensors or bytes is refused and the next donor asked."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import CompressionInfo, Float16Compression, NoCompression, Uniform8BitQuantization
from hivemind.optim.state_averager import dump_optimizer_state
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from conftest import wait_until
from cotrain.swarm import statecheck as sc
from cotrain.swarm.statelimit import STATE_SLACK_BYTES, StateBudget, StateTooLarge


def held_state(width: int = 64) -> tuple[dict, list[torch.Tensor]]:
    """A model's parameters and its Adam statistics, as a holder serves them (metadata, tensors)."""
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    meta, statistics = dump_optimizer_state(opt)
    return dict(epoch=3, optimizer_metadata=meta), [*model.parameters(), *statistics]


def served(metadata: dict, tensors: list[torch.Tensor], compression=None) -> list:
    """The messages hivemind's ``rpc_download_state`` streams for this state."""
    compression = compression or NoCompression()
    messages, first = [], MSGPackSerializer.dumps(metadata)
    for tensor in tensors:
        info = CompressionInfo.from_tensor(tensor.detach())
        for part in split_for_streaming(compression.compress(tensor.detach(), info, allow_inplace=False)):
            messages.append(averaging_pb2.DownloadData(tensor_part=part, metadata=first or b""))
            first = None
    return messages


def take_all(budget: StateBudget, messages: list) -> None:
    for message in messages:
        budget.take(message)


@pytest.mark.parametrize("compression", [NoCompression(), Float16Compression(), Uniform8BitQuantization()])
def test_an_honest_state_fits_its_own_budget(compression):
    metadata, tensors = held_state()
    budget = StateBudget(t.nbytes for t in tensors)
    take_all(budget, served(metadata, tensors, compression))
    assert budget.tensors == len(tensors) and budget.declared == sum(t.nbytes for t in tensors)


def test_a_state_with_more_tensors_or_bytes_than_ones_own_is_refused_as_it_comes():
    metadata, tensors = held_state()
    sizes = [t.nbytes for t in tensors]
    with pytest.raises(StateTooLarge, match="tensors, as many as"):  # one tensor more, even a tiny one
        take_all(StateBudget(sizes), served(metadata, [*tensors, torch.zeros(1)]))
    # a tensor that says it is larger: refused at its first part, before its bytes come
    bigger = [*tensors[:-1], torch.zeros(1 << 20)]
    budget, messages = StateBudget(sizes), served(metadata, bigger)
    with pytest.raises(StateTooLarge, match="tensors of more than"):
        take_all(budget, messages)
    assert budget.received < STATE_SLACK_BYTES + sum(sizes)
    # as many tensors, but more bytes than they say (the metadata, say)
    stuffed = served({**metadata, "junk": bytes(2 * STATE_SLACK_BYTES)}, tensors)
    with pytest.raises(StateTooLarge, match="more than .* bytes"):
        take_all(StateBudget(sizes), stuffed)
    odd = averaging_pb2.DownloadData(tensor_part=served(metadata, tensors)[0].tensor_part)
    odd.tensor_part.dtype = "no_such_dtype"
    with pytest.raises(StateTooLarge, match="unknown dtype"):
        StateBudget(sizes).take(odd)


class BloatedHolder(sc.CheckedTrainingStateAverager):
    """A state holder that serves its state and 8 MiB of tensors more."""

    def get_current_state(self):
        metadata, tensors, infos = super().get_current_state()
        extra = [torch.zeros(1 << 18) for _ in range(8)]
        return metadata, [*tensors, *extra], [*infos, *(CompressionInfo.from_tensor(t) for t in extra)]


@pytest.mark.timeout(120)
def test_a_newcomer_refuses_a_donor_that_serves_more_than_its_own_state_and_loads_the_next():
    """Real holders on DHTs on 127.0.0.1: an honest one at step 16 and one at step 19 (asked first) that
    serves 8 MiB of tensors more than the model's state. The newcomer refuses the larger stream and loads
    step 16; the holders' own sizes are those of the state they serve."""
    import hivemind

    run_id = "statelimit"
    dhts, holders = [], []

    def holder(kind: type, epoch: int | None) -> sc.CheckedTrainingStateAverager:
        initial = dhts[0].get_visible_maddrs() if dhts else []
        dhts.append(
            hivemind.DHT(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial, nat_port_map=False, start=True
            )
        )
        torch.manual_seed(0)
        made = kind(
            dht=dhts[-1],
            prefix=f"{run_id}_state_averager",
            optimizer=lambda params: torch.optim.Adam(params, lr=0.1),
            params=torch.nn.Linear(8, 4).parameters(),
            allow_state_sharing=epoch is not None,
            declare_state_period=5,
            start=True,
        )
        holders.append(made)
        if epoch is not None:
            made.local_epoch = epoch
            made.state_sharing_priority = epoch
        return made

    try:
        honest = holder(sc.CheckedTrainingStateAverager, 16)
        holder(BloatedHolder, 19)
        offered = f"{run_id}_state_averager.all_averagers"
        wait_until(
            lambda: len((dhts[0].get(offered, latest=True) or [{}])[0]) == 2, 30, what="both holders to serve"
        )
        _, tensors, _ = honest.get_current_state()
        assert honest.served_sizes() == [t.nbytes for t in tensors]
        newcomer = holder(sc.CheckedTrainingStateAverager, None)
        newcomer.load_state_from_peers(timeout=30)
        assert newcomer.local_epoch == 16
    finally:
        for made in holders:
            made.shutdown()
        for dht in dhts:
            dht.shutdown()
