"""DSpark draft math: context rows, the non-causal block pass, the Markov head.

The draft is the real tiny-kimi-k3-dspark checkpoint bound to a small real target
(embedding + LM head); caches come from the real CacheEngine.
"""

import pytest
import torch

from atom.config import load_hf_config
from atom.model_engine.cache_engine import CacheEngine
from atom.model_loader.loader import load_weights
from atom.model_ops.rotary_embedding import yarn_mscale
from atom.model_ops.sampler import probs_for
from atom.models.kimi_k3_dspark import KimiK3DSpark, MarkovHead
from atom.models.tiny import configs, resolve_model_path
from atom.spec_decode.dspark_proposer import draw_from, markov_decode
from tests.toy_target import ToyCausalLM

BLOCK_SIZE, NUM_BLOCKS, WIDTH, TAP_WIDTH = 4, 8, 4, 4 * 128
TABLE = list(range(NUM_BLOCKS))


@pytest.fixture(scope="module")
def draft_config():
    return load_hf_config(resolve_model_path("tiny-kimi-k3-dspark"))


@pytest.fixture
def draft(draft_config):
    model = KimiK3DSpark(draft_config, configs.k3_text_config())
    load_weights(model, resolve_model_path("tiny-kimi-k3-dspark"))
    model.share_with_target(ToyCausalLM(hidden=128, vocab=4096))
    CacheEngine([model], NUM_BLOCKS, BLOCK_SIZE, 0, 0, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    taps = torch.randn(12, TAP_WIDTH, generator=gen)
    model.write_context_kv(taps, torch.arange(12), torch.arange(12))
    return model.eval()


def logits(draft, ids, position):
    with torch.inference_mode():
        return draft.forward_block_rows(
            torch.tensor([ids]), torch.tensor([position]), [TABLE]
        )[0]


def test_context_rows_follow_the_spec(draft):
    gen = torch.Generator().manual_seed(1)
    taps, positions = torch.randn(3, TAP_WIDTH, generator=gen), torch.tensor([0, 5, 9])
    slots = torch.tensor([20, 21, -1])  # -1: a padding row, never written
    draft.write_context_kv(taps, positions, slots)
    context = draft.context_norm(draft.context_proj(taps))
    for layer in draft.layers:
        attn = layer.self_attn
        kv = attn.kv_a_proj_with_mqa(context)  # no input_layernorm on context rows
        c_kv = attn.kv_a_layernorm(kv[:, :32])
        k_pe = attn.rotary(positions, kv[:, 32:])
        flat = attn.kv_cache.view(-1, 48)
        torch.testing.assert_close(flat[20:22], torch.cat([c_kv, k_pe], -1)[:2])
        assert torch.equal(k_pe[0], kv[0, 32:])  # position 0 is not rotated
        assert not torch.equal(k_pe[1], kv[1, 32:])
    with pytest.raises(ValueError, match="taps_concat"):
        draft.write_context_kv(taps[:, :128], positions, slots)


def test_attention_scale_includes_the_yarn_mscale(draft):
    expected = (32 + 16) ** -0.5 * yarn_mscale(4.0, 1.0) ** 2
    assert draft.layers[0].self_attn.scale == pytest.approx(expected)
    assert draft.layers[0].self_attn.rotary.interleaved


def test_block_is_non_causal(draft):
    mask = draft.mask_token_id
    base = logits(draft, [42, mask, mask, mask], 6)
    changed = logits(draft, [42, mask, mask, 17], 6)
    assert not torch.allclose(base[0], changed[0])  # row T-1 reaches row 0
    assert base.dtype == torch.float32 and base.shape == (4, 4096)
    block = draft.block_forward(torch.tensor([42]), torch.tensor([6]), [TABLE], 4)
    assert torch.equal(block[0], base)


def test_context_rows_beyond_p_are_never_read(draft):
    mask = draft.mask_token_id
    ids, position = [42, mask, mask, mask], 6  # anchor at p+1 = 6: rows 0..5 read
    clean = logits(draft, ids, position)
    for layer in draft.layers:
        layer.self_attn.kv_cache.view(-1, 48)[position:] = float("nan")
    assert torch.equal(logits(draft, ids, position), clean)
    for layer in draft.layers:
        layer.self_attn.kv_cache.view(-1, 48)[position - 1] += 1.0
    assert not torch.allclose(logits(draft, ids, position), clean)


def test_batched_blocks_equal_single_blocks(draft):
    anchors, positions = torch.tensor([42, 7]), torch.tensor([6, 11])
    tables = [TABLE, TABLE]
    both = draft.block_forward(anchors, positions, tables, WIDTH)
    for b in range(2):
        one = draft.block_forward(
            anchors[b : b + 1], positions[b : b + 1], [TABLE], WIDTH
        )
        torch.testing.assert_close(both[b], one[0])


def test_markov_bias_is_w1_row_times_w2_in_fp32(draft):
    prev = torch.tensor([3, 1000])
    bias = draft.markov_bias(prev)
    head = draft.markov_head
    w1, w2 = head.markov_w1.weight.double(), head.markov_w2.weight.double()
    assert bias.dtype == torch.float32 and bias.shape == (2, 4096)
    torch.testing.assert_close(bias, (w1[prev] @ w2.t()).float())


def small_head(vocab=6, rank=2) -> MarkovHead:
    head = MarkovHead(vocab, rank)
    head.markov_w1.weight.zero_()
    head.markov_w2.weight.zero_()
    return head


def test_markov_bias_flips_the_argmax_and_chains():
    head = small_head()
    # Previous token 0 favours 4; previous token 4 favours 2.
    head.markov_w1.weight[0] = torch.tensor([1.0, 0.0])
    head.markov_w1.weight[4] = torch.tensor([0.0, 1.0])
    head.markov_w2.weight[4] = torch.tensor([2.0, 0.0])
    head.markov_w2.weight[2] = torch.tensor([0.0, 2.0])
    base = torch.zeros(1, 2, 6)
    base[0, :, 1] = 1.0  # the backbone alone says 1 at both positions
    drafts, probs = markov_decode(
        base, torch.tensor([0]), head.bias, [0.0], [0], [1.0], [None]
    )
    assert drafts.tolist() == [[4, 2]] and probs is None
    assert base[0].argmax(-1).tolist() == [1, 1]


def test_greedy_ties_take_the_lowest_index():
    greedy = ([0.0, 0.0], [0, 0], [1.0, 1.0], [None, None])
    drafts, _ = markov_decode(
        torch.zeros(2, 3, 6), torch.tensor([0, 5]), small_head().bias, *greedy
    )
    assert drafts.tolist() == [[0, 0, 0], [0, 0, 0]]


def test_sampled_q_is_the_exact_filtered_markov_distribution(draft):
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(2, 4, 4096, generator=gen)
    anchors = torch.tensor([8, 900])
    settings = ([0.7, 1.0], [0, 50], [0.9, 1.0])

    def run(seed):
        gens = [torch.Generator().manual_seed(seed) for _ in range(2)]
        return markov_decode(base, anchors, draft.markov_bias, *settings, gens)

    drafts, probs = run(11)
    again, probs_again = run(11)
    assert torch.equal(drafts, again) and torch.equal(probs, probs_again)
    prev = anchors
    for k in range(4):
        z = base[:, k] + draft.markov_bias(prev)
        assert torch.equal(probs[:, k], probs_for(z, *settings))
        assert bool((probs[:, k].gather(1, drafts[:, k, None]) > 0).all())
        prev = drafts[:, k]
    other, _ = run(12)
    assert not torch.equal(drafts, other)


def test_draw_from_inverts_the_cdf_and_skips_zero_mass():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 4)
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 1.0 - 2**-24])
    assert draw_from(probs, uniforms).tolist() == [1, 1, 3, 3]
    # u * mass rounding to the full mass still lands on a positive entry.
    assert draw_from(probs[:1], torch.tensor([1.0])).tolist() == [3]


def test_lengths_must_agree():
    with pytest.raises(ValueError, match="generators"):
        one_generator = ([0.0, 0.0], [0, 0], [1.0, 1.0], [None])
        markov_decode(
            torch.zeros(2, 1, 6),
            torch.tensor([0, 1]),
            small_head().bias,
            *one_generator,
        )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("target_layer_ids", [1, -1, 4, 6], "strictly increasing"),
        ("target_layer_ids", [-1, 1, 4, 8], "outside"),
        ("num_target_layers", 5, "num_target_layers"),
        ("target_num_hidden_layers", 9, "target_num_hidden_layers"),
        ("target_hidden_size", 64, "target_hidden_size"),
        ("hidden_size", 64, "hidden_size"),
        ("vocab_size", 8192, "vocab_size"),
        ("kv_lora_rank", 40, "latent width"),
        ("mask_token_id", 4096, "mask_token_id"),
        ("mla_use_output_gate", True, "output gate"),
        ("markov_rank", None, "markov_rank"),
    ],
)
def test_config_mismatches_are_refused(draft_config, field, value, message):
    fields = dict(draft_config)
    fields[field] = value
    if field == "vocab_size":
        fields["draft_vocab_size"] = value
    with pytest.raises(ValueError, match=message):
        KimiK3DSpark(fields, configs.k3_text_config())
