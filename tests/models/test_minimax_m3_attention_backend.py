"""tiny-minimax-m3 with `attention_backend="triton"` (decode and verify rows through
atom/kernels/paged_gqa_decode.py and paged_index_scores.py, under Triton's
interpreter on CPU) against `"torch"`: the same greedy ids and close logits, with
block-sparse selection live (20-token prompt: 5+ index blocks of 4, top-2 kept)."""

import pytest
import torch

from atom.config import Config
from atom.kernels import triton_available
from atom.model_ops.attention_backend import TorchGQABackend, TritonGQABackend
from atom.models.minimax_m3.attention import MiniMaxM3Attention
from atom.models.registry import get_model_class
from tests.models.kimi_helpers import bind_caches, build_target, logits_of, work

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "tiny-minimax-m3"
PROMPT = [(37 * i + 11) % 1000 for i in range(20)]
DECODE_STEPS = 1
DRAFTS = [5, 6]  # a verify forward of T + 1 = 3 rows
# Eight 4-token blocks a table (the prompt and every row here fit): the interpreter
# runs a program per block, so a narrower table keeps the test short.
TABLE_BLOCKS = 8


def attention_layers(model) -> list[MiniMaxM3Attention]:
    return [m for m in model.modules() if isinstance(m, MiniMaxM3Attention)]


@torch.inference_mode()
def generate(backend: str) -> tuple[list[int], torch.Tensor, torch.Tensor, list]:
    """(greedy ids, their logits, a verify forward's logits, the layers' backends):
    prefill PROMPT, decode DECODE_STEPS rows one at a time, then verify DRAFTS after
    the last greedy id; the ids include the verify rows' choices."""
    model, _ = build_target(MODEL, attention_backend=backend)
    bind_caches(model)
    logits = [logits_of(model, [work(PROMPT, num_blocks=TABLE_BLOCKS)])[-1]]
    tokens = []
    for step in range(DECODE_STEPS):
        tokens.append(int(logits[-1].argmax()))
        row = work(tokens[-1:], len(PROMPT) + step, num_blocks=TABLE_BLOCKS)
        logits.append(logits_of(model, [row])[0])
    tokens.append(int(logits[-1].argmax()))
    context = len(PROMPT) + DECODE_STEPS
    rows = work(tokens[-1:] + DRAFTS, context, num_drafts=2, num_blocks=TABLE_BLOCKS)
    verify = logits_of(model, [rows])
    backends = [layer._backend for layer in attention_layers(model)]
    return tokens + verify.argmax(-1).tolist(), torch.stack(logits), verify, backends


@pytest.mark.kernels
def test_triton_backend_decodes_as_the_torch_backend():
    if not triton_available("cpu"):
        pytest.skip("triton cannot run here")
    ids, logits, verify, backends = generate("triton")
    assert backends and all(isinstance(b, TritonGQABackend) for b in backends)
    ref_ids, ref_logits, ref_verify, ref_backends = generate("torch")
    assert all(isinstance(b, TorchGQABackend) for b in ref_backends)
    assert ids == ref_ids and len(set(ids)) > 1
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(verify, ref_verify, atol=1e-4, rtol=1e-4)


def test_every_attention_layer_gets_the_configured_backend():
    config = Config(model=MODEL, attention_backend="torch")
    model = get_model_class(config.hf_config.architecture)(config)
    layers = attention_layers(model)
    assert len(layers) == 6 and {layer.backend_choice for layer in layers} == {"torch"}
