"""atom's Kimi Linear against transformers' `KimiLinearForCausalLM` (TINY-KL).

transformers writes the checkpoint (`save_pretrained`, checkpoint tensor names), then
both run it: prefill logits, token-by-token decode through each side's own caches, and
greedy continuation. atom reads the saved folder unchanged (the q_a/kv_a norm eps of
1e-6 that transformers pins follows from the config being transformers-written). silu
because transformers uses `hidden_act` for the KDA conv too; eager attention, no hub
kernels.
"""

import os

import pytest
import torch

from tests.models.kimi_helpers import (
    bind_caches,
    build_target,
    logits_of,
    randomize,
    work,
)

os.environ["USE_HUB_KERNELS"] = "0"
transformers = pytest.importorskip("transformers")

TOL = {"atol": 1e-4, "rtol": 1e-4}
PROMPT = [5, 77, 301, 9, 640, 12, 999, 58, 410, 3, 150, 7, 888, 23, 64, 512, 17, 70]
NEW_TOKENS = 32


def tiny_kl_config(q_lora_rank: int | None):
    return transformers.KimiLinearConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_shared_experts=1,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.446,
        linear_attn_config={
            "num_heads": 4,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
        },
        first_k_dense_replace=1,
        hidden_act="silu",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )


@pytest.fixture(scope="module", params=[None, 64], ids=["q_proj", "q_lora64"])
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    reference = transformers.KimiLinearForCausalLM(tiny_kl_config(request.param))
    randomize(reference, seed=1 + (request.param or 0))
    reference.eval()
    folder = tmp_path_factory.mktemp("tiny-kl")
    reference.save_pretrained(folder)
    model, _ = build_target(str(folder))  # the folder as transformers wrote it
    return reference, model


@torch.no_grad()
def test_prefill_logits_match(pair):
    reference, model = pair
    expected = reference(torch.tensor([PROMPT])).logits[0]
    bind_caches(model)
    torch.testing.assert_close(logits_of(model, [work(PROMPT)]), expected, **TOL)


@torch.no_grad()
def test_decode_and_greedy_continuation_match(pair):
    reference, model = pair
    bind_caches(model)
    out = reference(torch.tensor([PROMPT]), use_cache=True)
    cache, ref_logits = out.cache, out.logits[0, -1]
    atom_logits = logits_of(model, [work(PROMPT)])[-1]
    ref_tokens, atom_tokens = [], []
    for step in range(NEW_TOKENS):
        torch.testing.assert_close(atom_logits, ref_logits, **TOL)
        ref_tokens.append(int(ref_logits.argmax()))
        atom_tokens.append(int(atom_logits.argmax()))
        if atom_tokens != ref_tokens:
            break
        token = ref_tokens[-1]
        out = reference(torch.tensor([[token]]), cache=cache, use_cache=True)
        cache, ref_logits = out.cache, out.logits[0, -1]
        atom_logits = logits_of(model, [work([token], len(PROMPT) + step)])[0]
    assert atom_tokens == ref_tokens
    assert len(atom_tokens) == NEW_TOKENS
    assert len(set(atom_tokens)) > 1, "a constant continuation would prove little"
