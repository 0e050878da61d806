"""Kimi-K3.1 is served by the Kimi-K3 implementation through ARCH_ALIASES."""

import json

import pytest

from atom.config import Config
from atom.models import registry


def write(folder, arch):
    folder.mkdir()
    text = {"num_hidden_layers": 8, "num_attention_heads": 4, "vocab_size": 1024}
    (folder / "config.json").write_text(
        json.dumps({"architectures": [arch], "text_config": text})
    )
    return str(folder)


def test_alias_resolves_to_k3():
    assert (
        registry.resolve_architecture("KimiK31ForConditionalGeneration")
        == "KimiK3ForConditionalGeneration"
    )
    assert registry.get_model_class(
        "KimiK31ForConditionalGeneration"
    ) is registry.get_model_class("KimiK3ForConditionalGeneration")


def test_serves_pp_speculation_for_k31(tmp_path):
    target = write(tmp_path / "k31", "KimiK31ForConditionalGeneration")
    draft = write(tmp_path / "draft", "K3DSparkModel")
    assert registry.serves_pp_speculation(
        Config(model=target, method="dspark", draft_model=draft)
    )
    assert not registry.serves_pp_speculation(Config(model=target))


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="unknown model architecture 'Llama'") as err:
        registry.get_model_class("Llama")
    assert "KimiK31ForConditionalGeneration" in str(err.value)
    assert "KimiK3ForConditionalGeneration" in str(err.value)


def test_declared_methods_share_the_embedding():
    for methods in registry.pp_speculative_methods.values():
        assert all(registry.METHOD_SHARES_EMBEDDING[m] for m in methods)
