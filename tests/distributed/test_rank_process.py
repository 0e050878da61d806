"""Rank processes: loopback-only sockets, results that reach the caller intact, and
no rank left once its caller is gone."""

import time

import torch

from atom.distributed.launch import run_ranks
from atom.distributed.parallel_state import get_tp_group
from atom.distributed.rank_process import CallerLink, link_to_caller, rank_context
from tests.process_helpers import is_loopback, listening_addresses


def own_listening_addresses(rank: int) -> list[str]:
    """Where this rank's process listens, after joining the world."""
    return listening_addresses()


def test_store_and_gloo_listen_on_loopback_only():
    listening = run_ranks(own_listening_addresses, tp_size=2)
    assert listening[0], "rank 0 serves the store, so it must listen somewhere"
    for rank, addresses in enumerate(listening):
        assert all(is_loopback(a) for a in addresses), (rank, addresses)


def tensors_and_objects(rank: int) -> dict:
    group = get_tp_group()
    summed = group.all_reduce(torch.full((1000, 64), float(rank + 1)))
    return {"rank": rank, "summed": summed, "view": summed[::7, 3], "tags": ["a", rank]}


def test_results_come_back_as_cpu_copies():
    first, second = run_ranks(tensors_and_objects, tp_size=2)
    assert (first["rank"], second["rank"]) == (0, 1)
    for result in (first, second):
        assert torch.equal(result["summed"], torch.full((1000, 64), 3.0))
        assert torch.equal(result["view"], torch.full((143,), 3.0))
        assert not result["summed"].is_shared()
    assert second["tags"] == ["a", 1]


def adopt_then_wait(link: CallerLink, watching) -> None:
    link.adopt()
    watching.set()
    time.sleep(600)


def test_a_rank_ends_when_its_caller_lets_go_of_the_lifeline():
    """Forked by the fork server, a rank is not its caller's child. Closing the
    write end is what the kernel does for a caller that dies."""
    ctx = rank_context()
    link, lifeline = link_to_caller(ctx)
    watching = ctx.Event()
    proc = ctx.Process(target=adopt_then_wait, args=(link, watching))
    proc.start()
    try:
        assert watching.wait(timeout=120)
        proc.join(timeout=1)
        assert proc.is_alive(), "the rank ended while its caller held on"
        lifeline.close()
        proc.join(timeout=60)
        assert proc.exitcode == 1
    finally:
        if proc.is_alive():
            proc.kill()
