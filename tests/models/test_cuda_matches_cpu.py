"""On CUDA the models run atom's Triton kernels (routing, expert alignment, gated
activations, KDA norms, ...); on the CPU the torch references. Greedy decoding of
the trained tiny models must give the same ids on both (fp32; CUDA only)."""

import pytest
import torch

from atom import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [
    "And God said unto Noah,",
    "In the beginning",
    "The LORD is my shepherd;",
    "And the king said",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def greedy_ids(model: str, device: str) -> list[list[int]]:
    # The torch KDA backend on both: fla's prefill multiplies fp32 in tf32, whose
    # rounding, not a kernel here, could flip a near-tied token (its own test
    # compares it with a tolerance).
    llm = LLMEngine(
        model,
        device=device,
        dtype="float32",
        max_num_seqs=4,
        max_model_len=256,
        kda_backend="torch",
    )
    try:
        return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()


@pytest.mark.parametrize("model", ["tiny-kimi-k3", "tiny-minimax-m3"])
def test_cuda_greedy_ids_equal_the_cpu_reference(model):
    assert greedy_ids(model, "cuda") == greedy_ids(model, "cpu")
