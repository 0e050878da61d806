"""atom's MiniMax-M3 against transformers' `MiniMaxM3SparseForConditionalGeneration`.

transformers builds the tiny model (the tiny-minimax-m3 text config, a 1-layer vision
tower), `save_pretrained` writes the released tensor layout with transformers'
config dialect; atom loads that folder, and a copy carrying the released-dialect
config.json. 40-token prompts (10 index blocks of 4, top-2 kept) make the block
selection matter. fp32, eager attention.
"""

import json
import shutil

import pytest
import torch

from atom.models.tiny.minimax_specs import minimax_text_config
from atom.models.utils import language_model_of
from tests.models.kimi_helpers import (
    assert_greedy_decode_matches,
    bind_caches,
    build_target,
    logits_of,
    work,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.minimax_m3_vl")

TOL = {"atol": 1e-4, "rtol": 1e-4}
PROMPT = [(37 * i + 11) % 1000 for i in range(40)]
OTHER = [(53 * i + 5) % 1000 for i in range(23)]
NEW_TOKENS = 24
DENSE_TOPK = 64  # more blocks than any prompt here has


pytestmark = pytest.mark.usefixtures("single_thread_torch")


def reference_config(text: dict):
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "patch_size": 2}  # fmt: skip
    return transformers.MiniMaxM3VLConfig(
        text_config=text,
        vision_config=vision,
        projector_hidden_size=64,
        attn_implementation="eager",
    )


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations, non-zero GemmaNorm offsets, a router bias that flips
    choices and an expert 0 whose pre-activations cross the swigluoai clamps."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if "language_model" not in name and "lm_head" not in name:
            continue
        noise = torch.randn(tensor.shape, generator=gen)
        if "norm" in name:
            tensor.copy_(0.1 * noise)
        elif name.endswith("e_score_correction_bias"):
            tensor.copy_(0.5 * noise)
        elif "embed_tokens" in name:
            tensor.copy_(noise)
        elif tensor.dim() >= 2:
            tensor.copy_(noise / tensor.shape[-1] ** 0.5)
            if name.endswith("experts.gate_up_proj"):
                tensor[0] *= 12.0
            if name == "lm_head.weight":
                tensor *= 2.0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(transformers model, its saved folder, the folder with the released config)."""
    torch.manual_seed(0)
    released = minimax_text_config()
    reference = transformers.MiniMaxM3SparseForConditionalGeneration(
        reference_config(released)
    )
    randomize(reference, seed=7)
    reference.eval()
    saved = tmp_path_factory.mktemp("minimax-saved")
    reference.save_pretrained(saved)
    config = json.loads((saved / "config.json").read_text())
    assert "sparse_attention_config" not in config["text_config"]  # its own dialect
    released_dir = tmp_path_factory.mktemp("minimax-released")
    shutil.copytree(saved, released_dir, dirs_exist_ok=True)
    config["text_config"] = released
    (released_dir / "config.json").write_text(json.dumps(config))
    return reference, saved, released_dir


@pytest.fixture(scope="module")
def atom_model(folders):
    _, _, released_dir = folders
    model, _ = build_target(str(released_dir))
    return model


def with_topk(folder, tmp_path, topk: int) -> str:
    """A copy of `folder` whose indexer keeps `topk` blocks."""
    out = tmp_path / f"topk{topk}"
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["sparse_attention_config"]["sparse_topk_blocks"] = topk
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@torch.no_grad()
def test_both_dialects_read_into_one_plan_and_the_same_logits(folders, atom_model):
    _, saved, _ = folders
    from_saved, _ = build_target(str(saved))
    plans = [language_model_of(m).model.text_config for m in (atom_model, from_saved)]
    assert plans[0] == plans[1]
    assert [layer.sparse_attention for layer in plans[0].layers] == [0, 0, 1, 1, 1, 1]
    for model in (atom_model, from_saved):
        bind_caches(model)
    torch.testing.assert_close(
        logits_of(from_saved, [work(PROMPT)]), logits_of(atom_model, [work(PROMPT)])
    )


@torch.no_grad()
def test_prefill_logits_match_for_a_mixed_batch(folders, atom_model):
    reference, _, _ = folders
    bind_caches(atom_model)
    logits = logits_of(
        atom_model, [work(PROMPT, slot=0), work(OTHER, slot=1, first_block=16)]
    )
    expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits[: len(PROMPT)], expected, **TOL)
    expected = reference(torch.tensor([OTHER])).logits[0]
    torch.testing.assert_close(logits[len(PROMPT) :], expected, **TOL)


@torch.no_grad()
def test_chunked_prefill_matches(folders, atom_model):
    """A chunk after cached rows reads keys (and index keys) back from the pages."""
    reference, _, _ = folders
    expected = reference(torch.tensor([PROMPT])).logits[0]
    bind_caches(atom_model)
    logits_of(atom_model, [work(PROMPT[:17])])
    chunk = logits_of(atom_model, [work(PROMPT[17:], 17)])
    torch.testing.assert_close(chunk, expected[17:], **TOL)


@torch.no_grad()
def test_decode_and_greedy_continuation_match(folders, atom_model):
    reference, _, _ = folders
    assert_greedy_decode_matches(reference, atom_model, PROMPT, NEW_TOKENS, TOL)


@torch.no_grad()
def test_forcing_topk_over_all_blocks_changes_the_logits(folders, atom_model, tmp_path):
    """No silent dense fallback: keeping every block must change what attends, from
    the first position whose context exceeds top-k blocks, and match transformers
    run with the same setting."""
    reference, _, released_dir = folders
    dense_dir = with_topk(released_dir, tmp_path, DENSE_TOPK)
    dense, _ = build_target(dense_dir)
    for model in (atom_model, dense):
        bind_caches(model)
    sparse_logits = logits_of(atom_model, [work(PROMPT)])
    dense_logits = logits_of(dense, [work(PROMPT)])
    block, topk = 4, 2
    within = block * topk  # positions 0..7 see at most top-k blocks
    torch.testing.assert_close(dense_logits[:within], sparse_logits[:within], **TOL)
    assert (dense_logits[within:] - sparse_logits[within:]).abs().max() > 1e-2
    dense_reference = (
        transformers.MiniMaxM3SparseForConditionalGeneration.from_pretrained(
            dense_dir, attn_implementation="eager"
        ).eval()
    )
    assert dense_reference.config.text_config.index_topk_blocks == DENSE_TOPK
    expected = dense_reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(dense_logits, expected, **TOL)
