"""tiny-kimi-k3 under real tensor / pipeline parallelism (gloo, one process per rank).

TP must reproduce the tp=1 logits; PP must hand across each boundary exactly the
tp=1 run's state at that layer (the tap p_out and the AttnRes bank, bit for bit) and
end in the same logits. Two steps run: a prefill batch, then decode + a prefill chunk.
"""

import pytest
import torch

from atom.distributed.launch import run_ranks
from atom.distributed.parallel_state import get_pp_group, get_tp_group
from atom.distributed.pp_comm import recv_tensor_dict, send_tensor_dict
from atom.models.utils import IntermediateTensors, language_model_of
from tests.models.kimi_helpers import bind_caches, build_target, forward_rows, work

MODEL = "tiny-kimi-k3"
SPLITS = ([4, 4], [3, 5], [5, 3])
# TP changes summation order, so TP results are close, not bit-equal.
CLOSE = {"atol": 1e-4, "rtol": 1e-4}
PROMPT_A = [5, 77, 301, 9, 640, 12, 999, 58, 410, 3, 150]
PROMPT_B = [700, 2, 19, 333, 45, 1000, 6, 81, 260]


def steps():
    """Step 1 prefills A and part of B; step 2 decodes A and prefills the rest of B."""
    return [
        [work(PROMPT_A, slot=0), work(PROMPT_B[:6], slot=1, first_block=16)],
        [
            work([42], len(PROMPT_A), slot=0),
            work(PROMPT_B[6:], 6, slot=1, first_block=16),
        ],
    ]


def run_steps(model) -> dict:
    """Run every step on this rank; PP stages exchange payloads through pp_comm."""
    pp = get_pp_group()
    bind_caches(model)
    out = {"payloads": [], "logits": []}
    for seqs in steps():
        received = None
        if not pp.is_first_rank:
            rows = sum(len(s.token_ids) for s in seqs)
            empty = model.make_empty_intermediate_tensors(rows, torch.float32, "cpu")
            got = recv_tensor_dict(torch.device("cpu"), set(empty.keys()))
            for key, tensor in got.items():
                assert tensor.shape == empty[key].shape, key  # stage-dependent shapes
            received = IntermediateTensors(got)
        result = forward_rows(model, seqs, received)
        if pp.is_last_rank:
            out["logits"].append(model.compute_logits(result))
        else:
            send_tensor_dict(dict(result.items()))
            out["payloads"].append({k: v.clone() for k, v in result.items()})
    return out


def rank_run(rank: int, splits: tuple) -> list[dict]:
    pp, tp = get_pp_group(), get_tp_group()
    outputs = []
    for split in splits:
        model, _ = build_target(
            MODEL,
            tensor_parallel_size=tp.world_size,
            pipeline_parallel_size=pp.world_size,
            pp_layer_partition=split,
        )
        outputs.append(run_steps(model))
    return outputs


@pytest.fixture(scope="module")
def reference(single_thread_torch):
    """tp=1 / pp=1 logits, plus p_out and the bank after every layer, per step."""
    model, _ = build_target(MODEL)
    layers = language_model_of(model).model.layers
    states: dict[int, tuple] = {}
    for index, layer in enumerate(layers):
        layer.register_forward_hook(
            lambda mod, args, out, i=index: states.__setitem__(
                i, (mod.aux_hidden_state(out), out[2])
            )
        )
    result = run_steps(model)
    per_step = []
    bind_caches(model)
    for seqs in steps():
        states.clear()
        forward_rows(model, seqs)
        per_step.append(dict(states))
    return result["logits"], per_step


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_tp1(reference, tp):
    expected, _ = reference
    for rank_out in run_ranks(rank_run, tp_size=tp, args=((None,),)):
        for got, want in zip(rank_out[0]["logits"], expected):
            torch.testing.assert_close(got, want, **CLOSE)


def test_pipeline_boundaries_are_bit_identical_to_pp1(reference):
    expected, states = reference
    first, last = run_ranks(rank_run, tp_size=1, pp_size=2, args=(SPLITS,))
    for split, sender, receiver in zip(SPLITS, first, last):
        boundary = split[0] - 1
        for step, payload in enumerate(sender["payloads"]):
            tap, bank = states[step][boundary]
            assert set(payload) == {"hidden_states", "block_residual"}
            assert torch.equal(payload["hidden_states"], tap), (split, step)
            assert torch.equal(payload["block_residual"], bank), (split, step)
        for got, want in zip(receiver["logits"], expected):
            assert torch.equal(got, want), split


def test_pipeline_times_tensor_parallel(reference):
    expected, states = reference
    ranks = run_ranks(rank_run, tp_size=2, pp_size=2, args=(([4, 4],),))
    for step, payload in enumerate(ranks[0][0]["payloads"]):
        tap, bank = states[step][3]
        torch.testing.assert_close(payload["hidden_states"], tap, **CLOSE)
        torch.testing.assert_close(payload["block_residual"], bank, **CLOSE)
        # The payload is replicated state: both TP ranks must send the same bits.
        twin = ranks[1][0]["payloads"][step]
        assert all(torch.equal(payload[key], twin[key]) for key in payload)
    for receiver in ranks[2:]:
        for got, want in zip(receiver[0]["logits"], expected):
            torch.testing.assert_close(got, want, **CLOSE)
