"""The DSpark draft: loading, binding to the target, and the drafter end to end.

Real tiny checkpoints (tiny-kimi-k3 target, tiny-kimi-k3-dspark with an embedding
copy, tiny-kimi-k31-dspark without), real modules, PP placement through structural
parallel groups. The draft's block math is in test_dspark_block.py.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from atom.config import SPECULATIVE_METHODS, Config, HFConfig, load_hf_config
from atom.distributed.parallel_state import build_parallel_state, get_pp_group
from atom.model_engine.batch import SeqWork
from atom.model_engine.cache_engine import CacheEngine
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_engine.model_runner import ModelRunner
from atom.model_loader.loader import WeightLoadingError, load_weights, parameter_bytes
from atom.models import causal_lm
from atom.models.kimi.dspark import KimiK3DSpark
from atom.models.qwen3_dspark.model import Qwen3DSpark
from atom.models.tiny import resolve_model_path
from atom.models.utils import PPMissingLayer, language_model_of
from atom.spec_decode.block_pass_graphs import block_pass_and_greedy_drafts
from atom.spec_decode.dspark_drafter import DSparkDrafter, check_shared_embedding
from atom.spec_decode.factory import DRAFTERS, build_drafter
from atom.utils.forward_context import ForwardContext, set_forward_context
from tests.models.kimi_helpers import target_of
from tests.spec_decode.spec_helpers import loaded_drafter, propose_on_host
from tests.toy_target import ToyCausalLM

TARGET, K3_DRAFT, K31_DRAFT = (
    "tiny-kimi-k3",
    "tiny-kimi-k3-dspark",
    "tiny-kimi-k31-dspark",
)
T, BLOCK_SIZE = 3, 4
PROMPT = [5, 77, 301, 9, 640, 12, 999, 58, 410, 3]


def make_config(draft: str = K3_DRAFT, model: str = TARGET, **kwargs) -> Config:
    return Config(
        model=model,
        method="dspark",
        draft_model=draft,
        num_speculative_tokens=T,
        max_num_batched_tokens=64,
        block_size=BLOCK_SIZE,
        **kwargs,
    )


@pytest.fixture(scope="module")
def pp1():
    config = make_config()
    target = target_of(config)
    return config, target, loaded_drafter(config, target)


@pytest.mark.parametrize("draft", [K3_DRAFT, K31_DRAFT])
def test_draft_loads_and_shares_the_target_objects(draft):
    config = make_config(draft)
    target = target_of(config, load=False)
    drafter = loaded_drafter(config, target)
    model, lm = drafter.model, target.language_model
    assert model.embed_tokens is lm.model.embed_tokens
    assert model.lm_head is lm.lm_head
    assert not isinstance(model.embed_tokens, PPMissingLayer)
    skipped = drafter.load_report.skipped_declared
    assert ("embed_tokens.weight" in skipped) == (draft == K3_DRAFT)
    assert "confidence_head.proj.weight" in skipped
    # The shared modules are not draft parameters: not loaded, not counted twice.
    names = [name for name, _ in model.named_parameters()]
    assert not any(n.startswith(("embed_tokens.", "lm_head.")) for n in names)
    assert drafter.own_parameter_bytes == parameter_bytes(model)
    shared = parameter_bytes(lm.model.embed_tokens) + parameter_bytes(lm.lm_head)
    assert drafter.shared_parameter_bytes == shared


def test_skip_weight_prefixes_is_one_class_level_list():
    config = make_config()
    drafters = [loaded_drafter(config, target_of(config, load=False))]
    with build_parallel_state(pp_rank=1, pp_size=2):
        pp_config = make_config(pipeline_parallel_size=2)
        drafters.append(loaded_drafter(pp_config, target_of(pp_config, load=False)))
    prefixes = KimiK3DSpark.skip_weight_prefixes
    assert type(prefixes) is list
    assert prefixes == ["confidence_head.", "embed_tokens.", "lm_head."]
    for drafter in drafters:
        assert "skip_weight_prefixes" not in vars(drafter.model)
        assert drafter.model.skip_weight_prefixes is prefixes


def _edited_draft(tmp_path, edit) -> str:
    source = resolve_model_path(K3_DRAFT)
    folder = tmp_path / "draft"
    shutil.copytree(source, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("layers.1.mlp.up_proj.weight"), "layers.1.mlp.gate_up_proj"),
        (
            lambda t: t.update({"layers.0.self_attn.extra.weight": torch.zeros(2)}),
            "layers.0.self_attn.extra.weight",
        ),
        (
            lambda t: t.update(
                {"layers.0.self_attn.q_b_proj.weight": torch.zeros(96, 64)}
            ),
            "num_attention_heads",
        ),
    ],
)
def test_missing_unknown_or_misshapen_draft_tensor_raises(tmp_path, edit, message):
    folder = _edited_draft(tmp_path, edit)
    draft = KimiK3DSpark(load_hf_config(folder))
    with pytest.raises(WeightLoadingError, match=message):
        load_weights(draft, folder)


@pytest.mark.parametrize(
    "target, draft, draft_class",
    [
        (TARGET, K3_DRAFT, KimiK3DSpark),
        ("tiny-minimax-m3", "tiny-minimax-m3-dspark", Qwen3DSpark),
    ],
    ids=["kimi-k3", "minimax-m3"],
)
def test_share_binds_a_placeholder_then_the_check_refuses_it(
    target, draft, draft_class
):
    """A last stage without speculation holds no table (pp_holds_embedding); the
    real share_with_target reads model.vocab_size (an AttributeError on
    num_embeddings would hide this), binds the placeholder, and
    check_shared_embedding refuses it."""
    with build_parallel_state(pp_rank=1, pp_size=2):
        config = Config(model=target, pipeline_parallel_size=2)
        lm = language_model_of(target_of(config, load=False))
    assert isinstance(lm.model.embed_tokens, PPMissingLayer)
    model = draft_class(load_hf_config(resolve_model_path(draft)))
    model.share_with_target(lm)
    assert model.embed_tokens is lm.model.embed_tokens
    with pytest.raises(TypeError, match="pp_holds_embedding") as info:
        check_shared_embedding(model)
    assert "pp_speculative_methods" in str(info.value)


@pytest.mark.parametrize(
    "target, draft, settings",
    [
        ("tiny-kimi-k31", K31_DRAFT, {}),
        (
            "tiny-minimax-m3",
            "tiny-minimax-m3-dspark-no-embed",
            {"num_kvcache_blocks": 8},
        ),
    ],
    ids=["kimi-k31", "minimax-m3"],
)
def test_reverted_placement_is_refused_at_start_up(
    monkeypatch, target, draft, settings
):
    """With the last stage's table reverted to a placeholder, start-up stops at
    check_shared_embedding's TypeError, not at an AttributeError on the way."""
    config = make_config(
        draft, model=target, pipeline_parallel_size=2, device="cpu", **settings
    )
    cpu = torch.device("cpu")
    with build_parallel_state(pp_rank=1, pp_size=2):
        runner = ModelRunner(config, cpu)  # the real placement builds and binds
        base = language_model_of(runner.model).model
        assert runner.drafter.model.embed_tokens is base.embed_tokens
        # Both targets build their stage through causal_lm's one call site.
        monkeypatch.setattr(
            causal_lm,
            "pp_holds_embedding",
            lambda cfg: get_pp_group().is_first_rank,
        )
        with pytest.raises(TypeError) as error:
            ModelRunner(config, cpu)
    message = str(error.value)
    assert "pp_speculative_methods" in message and "pp_holds_embedding" in message


def test_pp_last_stage_shares_a_real_table_and_never_hooks_it():
    with build_parallel_state(pp_rank=1, pp_size=2):
        config = make_config(pipeline_parallel_size=2)
        target = target_of(config, load=False)
        drafter = loaded_drafter(config, target)
    base = target.language_model.model
    assert not isinstance(base.embed_tokens, PPMissingLayer)
    assert drafter.model.embed_tokens is base.embed_tokens
    assert drafter.resident_taps == [4, 6]  # -1 and 1 come through the relay
    assert len(base.embed_tokens._forward_hooks) == 0
    assert len(base.layers[4]._forward_hooks) == 1


def test_vocab_mismatch_raises_naming_both_sizes():
    draft = KimiK3DSpark(load_hf_config(resolve_model_path(K3_DRAFT)))
    toy = ToyCausalLM(hidden=128, vocab=512)
    with pytest.raises(ValueError, match="4096.*512"):
        draft.share_with_target(toy)
    assert draft.embed_tokens is None


def test_check_skips_drafts_binding_another_name():
    class EmbedDraft(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = PPMissingLayer()

    check_shared_embedding(EmbedDraft())  # no embed_tokens: skipped
    declared = EmbedDraft()
    declared.shared_embedding_attr = "embed"
    with pytest.raises(TypeError, match="pp_speculative_methods"):
        check_shared_embedding(declared)


def test_check_rejects_an_unbound_table_when_proposing():
    draft = KimiK3DSpark(load_hf_config(resolve_model_path(K3_DRAFT)))
    with pytest.raises(TypeError, match="None"):
        check_shared_embedding(draft)
    check_shared_embedding(draft, will_propose=False)


def test_producer_skips_share_and_check_but_validates_vocab():
    # A producer's last stage builds no table: a check would raise here.
    with build_parallel_state(pp_rank=1, pp_size=2):
        config = make_config(pipeline_parallel_size=2, kv_role="kv_producer")
        target = target_of(config, load=False)
        drafter = loaded_drafter(config, target)
    assert isinstance(target.language_model.model.embed_tokens, PPMissingLayer)
    assert drafter.model.embed_tokens is None and drafter.model.lm_head is None
    assert drafter.resident_taps == [4, 6]
    with pytest.raises(RuntimeError, match="never drafts"):
        propose_on_host(drafter, [1], [3], [[0]], [0.0])
    producer = DSparkDrafter(make_config(kv_role="kv_producer"))
    with pytest.raises(ValueError, match="vocab_size"):
        producer.load_model(ToyCausalLM(hidden=128, vocab=512))


def _prefill(target, drafter, tokens, context_len=0, block_table=None):
    work = SeqWork(
        seq_id=0,
        token_ids=list(tokens),
        context_len=context_len,
        block_table=block_table or list(range(8)),
        state_slot=0,
    )
    ids, positions, metadata = prepare_inputs([work], BLOCK_SIZE, "cpu")
    with torch.inference_mode(), set_forward_context(ForwardContext(metadata)):
        hidden = target(ids, positions)
    drafter.precompute_context_kv(positions, metadata.slot_mapping, ids.numel())
    return hidden


def _caches(target, drafter) -> CacheEngine:
    modules = [target, drafter.model]
    return CacheEngine(modules, 16, BLOCK_SIZE, 2, 0, "cpu", torch.float32)


def test_prefill_then_propose_end_to_end(pp1):
    config, target, drafter = pp1
    _caches(target, drafter)
    _prefill(target, drafter, PROMPT)
    n = len(PROMPT)
    embedding = target.language_model.model.embed_tokens(torch.tensor(PROMPT))
    assert torch.equal(drafter.tap_buffers[-1][:n], embedding)
    taps_before = {t: buf.clone() for t, buf in drafter.tap_buffers.items()}
    anchors, positions, tables = [42, 7], [n, 5], [list(range(8))] * 2
    greedy = propose_on_host(drafter, anchors, positions, tables, [0.0] * 2)
    ids, probs = greedy.ids, greedy.probs
    assert ids.shape == (2, T) and ids.dtype == torch.long and probs is None
    assert bool(((ids >= 0) & (ids < 4096)).all())
    # The block pass embeds through the hooked table but records no tap.
    for tap, before in taps_before.items():
        assert torch.equal(drafter.tap_buffers[tap], before)
    mixed = [0.8, 0.0], [0.9, 1.0], [3, 3]  # temperatures, top-p, seeds
    sampled = propose_on_host(drafter, anchors, positions, tables, *mixed)
    ids, probs = sampled.ids, sampled.probs
    assert probs.shape == (2, T, 4096)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, T))
    assert bool((probs[0].gather(1, ids[0, :, None]) > 0).all())
    assert torch.equal(probs[1], nn.functional.one_hot(ids[1], 4096).float())
    # The greedy row of a mixed batch decodes as an all-greedy batch does, and so
    # does what a block-pass CUDA graph captures (run eagerly here).
    assert torch.equal(ids[1], greedy.ids[1])
    with torch.inference_mode():
        _, captured = block_pass_and_greedy_drafts(
            drafter.model,
            torch.tensor(anchors),
            torch.tensor(positions),
            torch.tensor(tables),
            T,
        )
    assert torch.equal(captured, greedy.ids)
    again = propose_on_host(drafter, anchors, positions, tables, *mixed)
    assert torch.equal(again.ids, ids) and torch.equal(again.probs, probs)
    with pytest.raises(ValueError, match="must agree"):
        propose_on_host(drafter, anchors, positions, tables[:1], [0.0, 0.0])


def test_chunked_prefill_writes_the_same_context_and_drafts(pp1):
    config, target, drafter = pp1
    results = []
    for chunks in ([PROMPT], [PROMPT[:4], PROMPT[4:7], PROMPT[7:]]):
        caches = _caches(target, drafter)
        done = 0
        for chunk in chunks:
            _prefill(target, drafter, chunk, context_len=done)
            done += len(chunk)
        draft_rows = [
            layer.kv_cache.clone()
            for layer in caches.kv_layers
            if layer in list(drafter.model.modules())
        ]
        ids = propose_on_host(drafter, [9], [done], [list(range(8))], [0.0]).ids
        results.append((draft_rows, ids))
    (one_rows, one_ids), (chunked_rows, chunked_ids) = results
    assert len(one_rows) == 2
    for a, b in zip(one_rows, chunked_rows):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.count_nonzero(a) > 0
    assert torch.equal(one_ids, chunked_ids)


def test_drafter_requires_a_draft_and_defaults_the_architecture():
    with pytest.raises(ValueError, match="speculative_config"):
        DSparkDrafter(Config(model=TARGET))
    config = make_config()
    spec = config.speculative_config
    spec.draft_hf_config = HFConfig(
        {k: v for k, v in spec.draft_hf_config.items() if k != "architectures"}
    )
    drafter = loaded_drafter(config, target_of(config, load=False))
    assert drafter.architecture == "K3DSparkModel"
    assert isinstance(drafter.model, KimiK3DSpark)


def test_the_factory_builds_the_drafter_of_the_method():
    assert isinstance(build_drafter(make_config()), DSparkDrafter)
    # Config offers exactly the methods that have a drafter.
    assert set(DRAFTERS) == set(SPECULATIVE_METHODS)
