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
    assert_greedy_decode_matches,
    bind_caches,
    build_target,
    logits_of,
    randomize,
    transformers_tiny_kl_config,
    work,
)

os.environ["USE_HUB_KERNELS"] = "0"
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kimi_linear")

TOL = {"atol": 1e-4, "rtol": 1e-4}
PROMPT = [5, 77, 301, 9, 640, 12, 999, 58, 410, 3, 150, 7, 888, 23, 64, 512, 17, 70]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=[None, 64], ids=["q_proj", "q_lora64"])
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    reference = transformers.KimiLinearForCausalLM(
        transformers_tiny_kl_config(request.param)
    )
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
    assert_greedy_decode_matches(reference, model, PROMPT, NEW_TOKENS, TOL)
