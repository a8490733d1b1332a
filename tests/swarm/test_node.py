"""A peer of several ranks (cotrain.engine.node): its ranks as processes of the test (torch.multiprocessing).

Here, the node's step against the one-process step; the rest in tests/unit/engine/test_node.py and
tests/live/test_node.py."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from cotrain.host.procs import exit_worker
from support.node import batch_of, tiny_llama


def _rank_main(rank: int, world: int, steps: int, rendezvous: str) -> None:
    """One rank of the in-process check (spawned): rank 0 drives, checks and raises on a mismatch."""
    import torch.distributed as dist

    from cotrain.engine.node import Node
    from cotrain.host.hardware import Precision
    from cotrain.host.ranks import RENDEZVOUS, init_ranks
    from cotrain.models import forward_loss
    from cotrain.optim import parameter_groups

    # the private rendezvous, as cotrain's own launch has it
    os.environ.update({RENDEZVOUS: rendezvous, "RANK": str(rank), "WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    init_ranks(torch.device("cpu"))
    adamw = lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)  # noqa: E731
    node = Node(tiny_llama(), lambda m: parameter_groups(m, 0.1), adamw, torch.device("cpu"))
    stream = (batch_of(rank, step) for step in range(10**6))
    precision = Precision(torch.device("cpu"))
    if rank:
        node.follow(stream, 1, precision, forward_loss)
        dist.destroy_process_group()
        return
    replica, reference = tiny_llama(), tiny_llama()
    replica_opt = node.inner_optimizer(adamw)(parameter_groups(replica, 0.1))
    node.attach(replica)
    ref_opt = adamw(parameter_groups(reference, 0.1))
    for step in range(steps):
        loss = node.accumulate(stream, 1, precision, forward_loss)
        norm = node.gradient_norm(1.0)
        replica_opt.step()  # the node's step, at the replica's learning rates
        replica_opt.zero_grad()
        # the same step in one process: the mean of the ranks' losses, clipped alike
        losses = [forward_loss(reference, batch_of(r, step)) for r in range(world)]
        ref_loss = sum(losses) / world
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss - ref_loss.item()) < 1e-5 and abs(norm - ref_norm.item()) < 1e-4, (loss, norm)
    node.pull()
    named = dict(replica.named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(named[name], param, atol=1e-5, rtol=1e-4, msg=name)
        ours, theirs = replica_opt.state[named[name]], ref_opt.state[param]
        torch.testing.assert_close(ours["exp_avg"], theirs["exp_avg"], atol=1e-6, rtol=1e-4, msg=name)
        assert int(ours["step"]) == steps
    with torch.no_grad():  # what rank 0 sends is what every rank then holds
        for param in replica.parameters():
            param.mul_(0.5)
        for state in replica_opt.state.values():
            state["exp_avg"].fill_(0.25)
    sent = {name: p.detach().clone() for name, p in replica.named_parameters()}
    node.push()
    with torch.no_grad():
        for param in replica.parameters():
            param.zero_()
    replica_opt.state.clear()
    node.pull()
    for name, param in replica.named_parameters():
        torch.testing.assert_close(param, sent[name], msg=name)
        assert bool((replica_opt.state[param]["exp_avg"] == 0.25).all()), name
    node.stop()
    dist.destroy_process_group()
    # as cotrain's own workers end: at interpreter exit, a gloo thread still winding down under load aborted
    # the rank ("terminate called without an active exception")
    exit_worker(0, None)


@pytest.mark.timeout(120)
def test_a_node_step_is_the_one_process_step_and_its_state_moves_whole():
    from cotrain.host.ranks import private_folder

    rendezvous = private_folder()
    try:
        mp.spawn(_rank_main, args=(2, 3, rendezvous), nprocs=2, join=True)
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)
