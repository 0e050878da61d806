"""Both fp8 flags on CUDA, end to end (CUDA only; skipped elsewhere).

The trained tiny K3 with DSpark (k = 7), bf16, CUDA graphs on (the default): with
ptpc_fp8 weights and an fp8 KV cache the engine captures its graphs, verifies
drafts, accepts within 2 points of bf16, and its KV blocks take fewer bytes. The
prompts and lengths are those of `tools/quant_accuracy.py` (16 held-out verse
openings of 32 tokens, 128 new tokens each), whose GPU figures docs/accuracy.md
lists; the figures are printed (run with -s).
"""

import pytest
import torch

from atom import LLMEngine, SamplingParams
from atom.models.tiny.excerpt import held_out_prompt_ids
from tests.spec_decode.spec_helpers import runner_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NUM_PROMPTS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
SETTINGS = dict(
    device="cuda",
    dtype="bfloat16",
    max_num_seqs=NUM_PROMPTS,
    max_model_len=256,
    method="dspark",
    draft_model="tiny-kimi-k3-dspark",
    num_speculative_tokens=7,
)
FP8 = dict(
    online_quant_config={"global_quant_config": "ptpc_fp8"}, kv_cache_dtype="fp8"
)
# Issue 22's bound. Held-out text, not random ids: on random-id prompts the tiny
# model's continuations degenerate, and acceptance over 8 of them swung by 12
# points with the trajectory a rounding flip chose (H100, 2026-12-06).
ACCEPTANCE_SLACK = 0.02


def prompts() -> list[list[int]]:
    return held_out_prompt_ids(NUM_PROMPTS, 32)


def run(**settings) -> tuple[list[list[int]], float, int]:
    """Greedy ids, DSpark acceptance and the bytes of one KV block of one engine."""
    llm = LLMEngine("tiny-kimi-k3", **SETTINGS, **settings)
    try:
        ids = [o["token_ids"] for o in llm.generate(prompts(), GREEDY)]
        assert runner_of(llm).graphs is not None
        assert runner_of(llm).drafter.block_graphs.captures
        stats = llm.get_spec_decode_stats()
        assert stats["num_verify_steps"] > 0
        block_bytes = runner_of(llm).cache.kv_bytes_per_block()
        return ids, stats["acceptance_rate"], block_bytes
    finally:
        llm.close()


def test_fp8_weights_and_kv_cache_with_dspark_and_graphs():
    bf16_ids, bf16_rate, bf16_bytes = run()
    fp8_ids, fp8_rate, fp8_bytes = run(**FP8)
    same = sum(a == b for a, b in zip(bf16_ids, fp8_ids))
    print(
        f"\nbf16: acceptance {bf16_rate:.2%}, {bf16_bytes} B per KV block; "
        f"fp8 weights + KV: acceptance {fp8_rate:.2%}, {fp8_bytes} B per KV block "
        f"(capacity {bf16_bytes / fp8_bytes:.2f}x); greedy ids identical "
        f"{same}/{len(fp8_ids)}"
    )
    assert all(len(ids) == GREEDY.max_tokens for ids in fp8_ids)
    assert fp8_rate >= bf16_rate - ACCEPTANCE_SLACK
    # Latent and draft rows take half the bytes; the recurrent state stays fp32.
    assert bf16_bytes > 1.5 * fp8_bytes
