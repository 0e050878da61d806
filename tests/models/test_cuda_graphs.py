"""Captured decode graphs replay the eager forward (CUDA only; skipped elsewhere).

Runs the real tiny K3 through the real ModelRunner: after one prefill, a decode step
through the graph and the same step run eagerly from the same caches give the same
logits, KV rows and recurrent states, for batch sizes that need padding. End to end,
DSpark with captured target and block-pass graphs emits exactly the eager
target-only greedy tokens (fp32).
"""

import pytest
import torch

from atom import LLMEngine, SamplingParams
from atom.config import Config
from atom.model_engine.model_runner import ModelRunner
from tests.models.kimi_helpers import work
from tests.spec.spec_helpers import runner_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BLOCK = 16


def build_runner(dtype: str) -> ModelRunner:
    config = Config(
        model="tiny-kimi-k3",
        device="cuda",
        dtype=dtype,
        block_size=BLOCK,
        max_model_len=256,
        max_num_seqs=8,
        num_kvcache_blocks=64,
        cudagraph_capture_sizes=[1, 2, 4, 8],
    )
    runner = ModelRunner(config, torch.device("cuda"))
    runner.allocate_caches(64)
    return runner


def snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    """Every request-owned cache row (the scratch block and slot excluded: only the
    graph's padding sequences write there)."""
    cache = runner.cache
    blocks, slots = cache.num_blocks, cache.num_state_slots
    tensors = [m.kv_cache[:blocks] for m in cache.kv_layers]
    tensors += [m.ssm_state[:slots] for m in cache.state_layers]
    tensors += [m.conv_state[:slots] for m in cache.state_layers]
    return [t.clone() for t in tensors]


def restore(runner: ModelRunner, saved: list[torch.Tensor]) -> None:
    cache = runner.cache
    tensors = [m.kv_cache for m in cache.kv_layers]
    tensors += [m.ssm_state for m in cache.state_layers]
    tensors += [m.conv_state for m in cache.state_layers]
    for tensor, value in zip(tensors, saved):
        tensor.copy_(value)


TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_seqs", [1, 3, 6])
def test_graph_decode_equals_eager_decode(num_seqs, dtype):
    runner = build_runner(dtype)
    assert runner.graphs is not None, "the tiny K3 must capture on CUDA"
    tol = TOLERANCE[dtype]
    gen = torch.Generator().manual_seed(num_seqs)
    prompts = [
        torch.randint(0, 1000, (20 + 3 * i,), generator=gen).tolist()
        for i in range(num_seqs)
    ]
    blocks = 8
    with torch.inference_mode():
        runner._forward(
            [
                work(p, slot=i, first_block=blocks * i, num_blocks=blocks)
                for i, p in enumerate(prompts)
            ],
            None,
        )
        step = [
            work([7 + i], len(p), slot=i, first_block=blocks * i, num_blocks=blocks)
            for i, p in enumerate(prompts)
        ]
        assert runner.graphs.size_for(step) is not None
        before = snapshot(runner)
        graph_out, _, _ = runner._forward(step, None)
        graph_logits = runner.model.compute_logits(graph_out).float()
        graph_caches = snapshot(runner)
        restore(runner, before)
        graphs, runner.graphs = runner.graphs, None
        eager_out, _, _ = runner._forward(step, None)
        runner.graphs = graphs
        eager_logits = runner.model.compute_logits(eager_out).float()
    torch.testing.assert_close(graph_logits, eager_logits, atol=tol, rtol=tol)
    for graph_tensor, eager_tensor in zip(graph_caches, snapshot(runner)):
        torch.testing.assert_close(
            graph_tensor.float(), eager_tensor.float(), atol=tol, rtol=tol
        )


def test_dspark_with_graphs_emits_the_eager_target_only_tokens():
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 1000, (12 + 5 * i,), generator=gen).tolist() for i in range(5)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256)
    runs = {}
    for name, extra in (
        ("eager", dict(enforce_eager=True)),
        ("dspark", dict(method="dspark", num_speculative_tokens=7)),
    ):
        llm = LLMEngine("tiny-kimi-k3", **common, **extra)
        runs[name] = [o["token_ids"] for o in llm.generate(prompts, params)]
        if name == "dspark":
            assert runner_of(llm).graphs is not None
            assert runner_of(llm).drafter.block_graphs is not None
            assert llm.get_spec_decode_stats()["num_verify_steps"] > 0
        llm.close()
    assert runs["dspark"] == runs["eager"]
