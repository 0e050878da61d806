"""Checkpoints transformers writes load unchanged in atom and decode as transformers.

Each case is a `KimiLinearConfig` built from a minimal keyword set (transformers'
defaults everywhere else) at tiny sizes, with seeded random weights, written by
`save_pretrained` into a temp folder that gets no tokenizer and no hand edits. atom's
`LLMEngine` serves the folder as is (token-id prompts, `skip_tokenizer_init`), and its
greedy continuations of a batch of prompts must equal transformers' `generate` in
fp32.
"""

import os

import pytest
import torch

from atom import LLMEngine, SamplingParams
from tests.models.kimi_helpers import (
    TRANSFORMERS_MLA_FIRST_ALL_MOE,
    TRANSFORMERS_TINY_KDA_WIDTHS,
    TRANSFORMERS_TINY_WIDTHS,
    randomize,
)

os.environ["USE_HUB_KERNELS"] = "0"
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("single_thread_torch")

VOCAB = TRANSFORMERS_TINY_WIDTHS["vocab_size"]
PROMPT_LEN, NEW_TOKENS, NUM_PROMPTS = 12, 16, 3
# Sizes only; every other field keeps transformers' default.
SIZES = dict(TRANSFORMERS_TINY_WIDTHS, num_local_experts=8, num_experts_per_tok=2)

CASES = {
    # transformers' own schedule (MLA at layer 4) and dense-first default, q_proj.
    "default_schedule_q_proj": dict(
        num_hidden_layers=5, linear_attn_config=TRANSFORMERS_TINY_KDA_WIDTHS
    ),
    # q-LoRA, MLA first, every layer MoE.
    "q_lora_mla_first_all_moe": TRANSFORMERS_MLA_FIRST_ALL_MOE,
    # Schedules given as transformers' type lists; two dense layers; grouped routing.
    "type_lists_two_dense_grouped": dict(
        num_hidden_layers=4,
        layer_types=[
            "linear_attention",
            "full_attention",
            "full_attention",
            "linear_attention",
        ],
        mlp_layer_types=["dense", "dense", "sparse", "sparse"],
        linear_num_heads=4,
        linear_head_dim=16,
        n_group=4,
        topk_group=2,
    ),
}


def prompts_for(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (NUM_PROMPTS, PROMPT_LEN), generator=gen).tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_continuations_equal_transformers_generate(case, tmp_path):
    seed = sorted(CASES).index(case)
    torch.manual_seed(seed)
    config = transformers.KimiLinearConfig(
        **SIZES, **CASES[case], attn_implementation="eager"
    )
    reference = transformers.KimiLinearForCausalLM(config)
    randomize(reference, seed=100 + seed)
    reference.eval().save_pretrained(tmp_path)
    prompts = prompts_for(seed)
    ids = torch.tensor(prompts)
    with torch.no_grad():
        generated = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = generated[:, PROMPT_LEN:].tolist()

    engine = LLMEngine(
        str(tmp_path),
        skip_tokenizer_init=True,
        device="cpu",
        max_model_len=PROMPT_LEN + NEW_TOKENS + 8,
        max_num_seqs=NUM_PROMPTS,
    )
    try:
        assert engine.config.torch_dtype == torch.float32  # read from "dtype"
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        results = engine.generate(prompts, params)
    finally:
        engine.close()
    assert [r["token_ids"] for r in results] == expected
    assert all(r["text"] == "" for r in results)
    assert all(len(set(tokens)) > 1 for tokens in expected), "constant continuation"
