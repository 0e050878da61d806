"""The golden reference against transformers' Kimi Linear.

transformers 5.24 `save_pretrained` writes the *checkpoint* names for kimi_linear
(`self_attn.q_conv1d`, `self_attn.f_a_proj`, `block_sparse_moe.experts.{e}.w1`, ...),
except that the dense layer comes out as `block_sparse_moe.{gate,up,down}_proj`;
`atom.models.kimi.hf_names` maps both that and the in-memory names back.
"""

import math
import os

import pytest
import torch

from atom.models.kimi.hf_names import to_checkpoint_names
from atom.models.tiny import resolve_model_path
from atom.models.tiny.configs import TOKEN_IDS, kimi_linear_config
from atom.models.tiny.weights import kimi_linear_specs
from tests.models.kimi_helpers import transformers_tiny_kl_config
from tests.reference.k3_golden import GoldenModel

# transformers would otherwise try hub kernels; it runs its pure-torch fallbacks.
os.environ["USE_HUB_KERNELS"] = "0"
TRANSFORMERS_MLA_NORM_EPS = 1e-6  # transformers hard-codes the q_a/kv_a norm eps
SEQ_LEN = 70  # crosses transformers' 64-token KDA chunk


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Replace transformers' near-zero init so every path carries signal."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [*module.named_parameters(), *module.named_buffers()]
    with torch.no_grad():
        for name, t in sorted(tensors, key=lambda item: item[0]):
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith("A_log"):
                t.copy_((torch.rand(t.shape, generator=gen) * 15 + 1).log())
            elif name.endswith("dt_bias"):
                dt = (
                    torch.rand(t.shape, generator=gen) * math.log(100) - math.log(1e3)
                ).exp()
                t.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.05 * noise)
            elif t.dim() == 1:
                t.copy_(1 + 0.1 * noise)
            elif "embed_tokens" in name:
                t.copy_(noise)
            else:
                gain = 2.0 if name.startswith("lm_head") else 1.0
                t.copy_(gain * noise / math.sqrt(t.shape[-1]))


def _random_ids(seed: int, n: int = SEQ_LEN) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    plain = TOKEN_IDS["bos_token_id"]  # the special tokens sit above the plain ones
    return torch.randint(0, plain, (n,), generator=gen).tolist()


def _transformers_forward(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


@pytest.fixture(scope="module", params=[None, 64], ids=["plain-q", "q-lora-64"])
def saved_transformers_model(request, tmp_path_factory):
    from transformers import KimiLinearForCausalLM

    model = (
        KimiLinearForCausalLM(transformers_tiny_kl_config(request.param)).float().eval()
    )
    _randomize(model, seed=7)
    path = tmp_path_factory.mktemp("hf_kimi_linear")
    model.save_pretrained(path)
    return model, path


def test_save_pretrained_writes_checkpoint_names(saved_transformers_model):
    from safetensors import safe_open

    _, path = saved_transformers_model
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_conv1d.weight" in names
    assert "model.layers.0.self_attn.f_a_proj.weight" in names
    assert "model.layers.1.block_sparse_moe.experts.7.w1.weight" in names
    assert not any(
        "forget_gate" in n or "gate_up_proj" in n or ".conv1d" in n for n in names
    )
    # Quirk: the reversed `block_sparse_moe -> mlp` rename also hits the dense layer.
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names


def test_hf_names_maps_transformers_state_onto_tiny_checkpoint_names(
    saved_transformers_model,
):
    from safetensors.torch import load_file

    model, path = saved_transformers_model
    from_memory = to_checkpoint_names(model.state_dict())
    from_disk = to_checkpoint_names(load_file(str(path / "model.safetensors")))
    assert from_memory.keys() == from_disk.keys()
    for name, tensor in from_memory.items():
        assert torch.equal(tensor, from_disk[name]), name
    # The same names and shapes the tiny Kimi Linear checkpoint is generated with.
    config = kimi_linear_config()
    config["q_lora_rank"] = model.config.q_lora_rank
    expected = {spec.name: spec.shape for spec in kimi_linear_specs(config)}
    assert {n: tuple(t.shape) for n, t in from_memory.items()} == expected
    assert to_checkpoint_names(from_memory).keys() == from_memory.keys()


def test_golden_matches_transformers_prefill(saved_transformers_model):
    model, path = saved_transformers_model
    golden = GoldenModel.from_pretrained(path, mla_norm_eps=TRANSFORMERS_MLA_NORM_EPS)
    ids = _random_ids(seed=1)
    logits, hidden_states = golden(ids)
    ref_logits, ref_hidden = _transformers_forward(model, ids)
    assert logits.std() > 1.0  # a live model, not near-zero logits
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    # transformers' last entry is the final-normed output; the rest are the taps.
    layers = golden.num_layers
    for k in range(layers):
        torch.testing.assert_close(hidden_states[k], ref_hidden[k], atol=1e-4, rtol=0)
    norm = model.model.norm
    torch.testing.assert_close(
        norm(hidden_states[layers]), ref_hidden[layers], atol=1e-4, rtol=0
    )


def test_golden_mla_eps_is_switchable(saved_transformers_model):
    """Default eps follows rms_norm_eps (1e-5), which visibly differs from 1e-6."""
    model, path = saved_transformers_model
    ids = _random_ids(seed=2, n=12)
    logits, _ = GoldenModel.from_pretrained(path)(ids)
    ref_logits, _ = _transformers_forward(model, ids)
    assert (logits - ref_logits).abs().max() > 1e-5


def test_tiny_kimi_linear_loads_in_transformers_and_matches_golden():
    from transformers import KimiLinearForCausalLM

    path = resolve_model_path("tiny-kimi-linear")
    model, info = KimiLinearForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    ids = _random_ids(seed=3)
    golden = GoldenModel.from_pretrained(path, mla_norm_eps=TRANSFORMERS_MLA_NORM_EPS)
    ref_logits, _ = _transformers_forward(model.eval(), ids)
    torch.testing.assert_close(golden(ids)[0], ref_logits, atol=1e-4, rtol=0)


def test_golden_lower_bounded_kda_matches_glm5_next():
    """glm5_next's linear attention is KDA with the K3 lower-bounded forget gate."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import (
        Glm5NextTextLinearAttention,
    )

    lac = {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4}
    config = Glm5NextTextConfig(
        hidden_size=128,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        hidden_act="silu",
        rms_norm_eps=1e-5,
        linear_attn_config={**lac, "gate_lower_bound": -5.0},
    )
    attention = Glm5NextTextLinearAttention(config, layer_idx=0).float().eval()
    _randomize(attention, seed=11)
    prefix = "model.layers.0.self_attn."
    tensors = {}
    for name, t in attention.state_dict().items():
        if name == "conv1d.weight":  # stacked q, k, v convs
            for part, chunk in zip("qkv", t.chunk(3)):
                tensors[f"{prefix}{part}_conv1d.weight"] = chunk
        else:
            tensors[prefix + name.removeprefix("forget_gate.")] = t
    golden = GoldenModel(
        {
            "num_hidden_layers": 1,
            "rms_norm_eps": 1e-5,
            "linear_attn_config": {
                **lac,
                "gate_lower_bound": -5.0,
                "kda_layers": [1],
                "full_attn_layers": [],
            },
        },
        tensors,
    )
    x = torch.randn(SEQ_LEN, 128, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = attention(x[None])[0]
    torch.testing.assert_close(golden._kda(prefix, x), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["tiny-kimi-k3", "tiny-kimi-linear"])
def test_golden_is_causal_and_taps_are_consistent(name):
    """Extending the sequence leaves earlier logits and taps unchanged."""
    golden = GoldenModel.from_pretrained(resolve_model_path(name))
    ids = _random_ids(seed=4, n=24)
    logits, hidden_states = golden(ids)
    short_logits, short_hidden = golden(ids[:10])
    # Only matmul blocking differs between the two lengths.
    torch.testing.assert_close(short_logits, logits[:10], atol=1e-4, rtol=0)
    assert len(hidden_states) == golden.num_layers + 1
    embedding = golden.w("model.embed_tokens.weight")[torch.tensor(ids)]
    torch.testing.assert_close(hidden_states[0], embedding)
    for short, full in zip(short_hidden, hidden_states):
        torch.testing.assert_close(short, full[:10], atol=1e-4, rtol=0)
