"""tiny-minimax-m3 in every (tp, pp) of {1, 2, 4} x {1, 2}, against tp1 / pp1.

One world of 8 gloo processes runs the five layouts in turn (`layout_parallel_state`),
each on two steps: a prefill batch (a 40-token prompt and a chunk of another), then a
decode row plus the rest of the chunked prompt. tp 4 replicates the 2 KV heads and
the index heads that select for them. PP alone keeps the arithmetic, so pp2 x tp1
must be bit-identical; TP changes summation order, so TP layouts are close.
"""

import pytest
import torch

from atom.distributed.launch import run_ranks
from atom.distributed.parallel_state import (
    get_pp_group,
    get_tp_group,
    layout_parallel_state,
)
from atom.distributed.pp_comm import recv_tensor_dict, send_tensor_dict
from atom.models.utils import IntermediateTensors
from tests.models.kimi_helpers import bind_caches, build_target, forward_rows, work

MODEL = "tiny-minimax-m3"
LAYOUTS = [(2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]  # (tp, pp)
CLOSE = {"atol": 1e-4, "rtol": 1e-4}
PROMPT_A = [(37 * i + 11) % 1000 for i in range(40)]
PROMPT_B = [(53 * i + 5) % 1000 for i in range(23)]


def steps():
    return [
        [work(PROMPT_A, slot=0), work(PROMPT_B[:14], slot=1, first_block=16)],
        [
            work([42], len(PROMPT_A), slot=0),
            work(PROMPT_B[14:], 14, slot=1, first_block=16),
        ],
    ]


def run_steps(model) -> list[torch.Tensor]:
    """Logits of every step on the last stage (empty elsewhere)."""
    pp = get_pp_group()
    bind_caches(model)
    logits = []
    for seqs in steps():
        received = None
        if not pp.is_first_rank:
            received = IntermediateTensors(
                recv_tensor_dict(torch.device("cpu"), {"hidden_states", "residual"})
            )
        result = forward_rows(model, seqs, received)
        if pp.is_last_rank:
            logits.append(model.compute_logits(result))
        else:
            send_tensor_dict(dict(result.items()))
    return logits


def rank_run(rank: int) -> dict:
    """Logits per layout, reported by the last stage's TP rank 0."""
    results = {}
    for tp, pp in LAYOUTS:
        with layout_parallel_state(tp, pp) as member:
            if not member:
                continue
            model, _ = build_target(
                MODEL, tensor_parallel_size=tp, pipeline_parallel_size=pp
            )
            logits = run_steps(model)
            if get_pp_group().is_last_rank and get_tp_group().is_first_rank:
                results[(tp, pp)] = logits
    return results


@pytest.fixture(scope="module")
def reference() -> list[torch.Tensor]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run, for the bit-identical pp2 check
    try:
        model, _ = build_target(MODEL)
        return run_steps(model)
    finally:
        torch.set_num_threads(saved)


def test_every_layout_matches_tp1_pp1(reference):
    merged = {}
    for rank_results in run_ranks(rank_run, tp_size=8):
        merged.update(rank_results)
    assert sorted(merged) == sorted(LAYOUTS)
    for layout, logits in merged.items():
        assert len(logits) == len(reference)
        for got, want in zip(logits, reference):
            if layout == (1, 2):
                assert torch.equal(got, want), layout
            else:
                torch.testing.assert_close(got, want, **CLOSE, msg=str(layout))
