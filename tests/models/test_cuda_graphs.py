"""Captured decode graphs replay the eager forward (CUDA only; skipped elsewhere).

Runs the real tiny K3 in bf16 (grouped expert GEMMs need it to be capturable) through
the real ModelRunner: after one prefill, a decode (and a verify) step through the
graph and the same step run eagerly from the same caches give the same logits, KV
rows and recurrent states within bf16 tolerance, for batch sizes that need padding.
"""

import pytest
import torch

from atom.config import Config
from atom.model_engine.model_runner import ModelRunner
from tests.models.kimi_helpers import work

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BLOCK = 16


def build_runner(**kwargs) -> ModelRunner:
    config = Config(
        model="tiny-kimi-k3",
        device="cuda",
        dtype="bfloat16",
        block_size=BLOCK,
        max_model_len=256,
        max_num_seqs=8,
        num_kvcache_blocks=64,
        cudagraph_capture_sizes=[1, 2, 4, 8],
        **kwargs,
    )
    runner = ModelRunner(config, torch.device("cuda"))
    runner.allocate_caches(64, 0)
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


@pytest.mark.parametrize("num_seqs", [1, 3, 6])
def test_graph_decode_equals_eager_decode(num_seqs):
    runner = build_runner()
    assert runner.graphs is not None, "bf16 on CUDA must capture"
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
    torch.testing.assert_close(graph_logits, eager_logits, atol=5e-2, rtol=5e-2)
    assert (graph_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean() >= 0.8
    for graph_tensor, eager_tensor in zip(graph_caches, snapshot(runner)):
        torch.testing.assert_close(
            graph_tensor.float(), eager_tensor.float(), atol=5e-2, rtol=5e-2
        )
