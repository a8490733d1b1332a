"""The cap on a state download (cotrain.algorithms.statelimit).

Here, in the test process alone; the rest in tests/swarm/test_statelimit.py."""

from __future__ import annotations

import functools

import pytest
import torch
from hivemind.compression import CompressionInfo, Float16Compression, NoCompression, Uniform8BitQuantization
from hivemind.optim.state_averager import dump_optimizer_state
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from cotrain.algorithms.statelimit import (
    TENSORS_PER_PARAMETER,
    StateBudget,
    StateTooLarge,
    state_bound,
)


def held_state(width: int = 64, optimizer=None) -> tuple[dict, list[torch.Tensor], tuple[int, int]]:
    """A model's parameters and its optimizer's statistics (Adam with amsgrad: the most full-size ones), as a
    holder serves them (metadata, tensors), and the bound on such a state."""
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    opt = (optimizer or functools.partial(torch.optim.Adam, amsgrad=True))(model.parameters())
    bound = state_bound(list(model.parameters()))  # before the first step: no statistics yet
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    meta, statistics = dump_optimizer_state(opt)
    return dict(epoch=3, optimizer_metadata=meta), [*model.parameters(), *statistics], bound


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
@pytest.mark.parametrize("optimizer", ["adam-amsgrad", "lamb"])
def test_an_honest_state_fits_the_bound_of_its_model(compression, optimizer):
    from cotrain.optim import Lamb

    make = Lamb if optimizer == "lamb" else None  # LAMB: five tensors a parameter
    metadata, tensors, bound = held_state(optimizer=make)
    budget = StateBudget(*bound)
    take_all(budget, served(metadata, tensors, compression))
    assert budget.tensors == len(tensors) and budget.declared == sum(t.nbytes for t in tensors)
    assert len(tensors) <= bound[0] == 4 * (1 + TENSORS_PER_PARAMETER)


def test_a_state_with_more_tensors_or_bytes_than_its_model_holds_is_refused_as_it_comes():
    metadata, tensors, bound = held_state()
    extra = [torch.zeros(1)] * (bound[0] - len(tensors) + 1)
    with pytest.raises(StateTooLarge, match="tensors, the most a state"):  # one tensor more, even a tiny one
        take_all(StateBudget(*bound), served(metadata, [*tensors, *extra]))
    # a tensor that says it is larger: refused at its first part, before its bytes come
    bigger = [*tensors[:-1], torch.zeros(1 << 20)]
    budget, messages = StateBudget(*bound), served(metadata, bigger)
    with pytest.raises(StateTooLarge, match="tensors of more than"):
        take_all(budget, messages)
    assert budget.received < budget.max_bytes
    # as many tensors, but more bytes than they say (the metadata, say)
    stuffed = served({**metadata, "junk": bytes(2 * budget.max_bytes)}, tensors)
    with pytest.raises(StateTooLarge, match="more than .* bytes"):
        take_all(StateBudget(*bound), stuffed)
    odd = averaging_pb2.DownloadData(tensor_part=served(metadata, tensors)[0].tensor_part)
    odd.tensor_part.dtype = "no_such_dtype"
    with pytest.raises(StateTooLarge, match="unknown dtype"):
        StateBudget(*bound).take(odd)
