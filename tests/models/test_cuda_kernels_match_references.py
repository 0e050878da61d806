"""On CUDA the models run atom's Triton kernels (routing, expert alignment and
combine, gated activations, KDA gates and norms, MLA decode, ...); with
ATOM_DISABLE_TRITON=1 every op runs its torch reference instead. Greedy decoding of
the trained tiny models must give the same ids both ways (fp32, one GPU; CUDA only)."""

import pytest
import torch

from atom import LLMEngine, SamplingParams
from atom.kernels import DISABLE_ENV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [
    "And God said unto Noah,",
    "In the beginning",
    "The LORD is my shepherd;",
    "And the king said",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def greedy_ids(model: str) -> list[list[int]]:
    # The torch KDA backend both ways: with the kernels off, "auto" would pick fla,
    # whose tf32 products (compared with a tolerance elsewhere), not a kernel
    # here, could then flip a near-tied token.
    llm = LLMEngine(
        model,
        device="cuda",
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
def test_greedy_ids_with_the_kernels_equal_the_torch_references(model, monkeypatch):
    with_kernels = greedy_ids(model)
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert greedy_ids(model) == with_kernels
