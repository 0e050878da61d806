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
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.models.dspark_base import MarkovHead
from atom.models.kimi.dspark import KimiK3DSpark
from atom.models.tiny import configs, resolve_model_path
from atom.spec_decode.markov_head import markov_decode
from tests.toy_target import ToyCausalLM

BLOCK_SIZE, NUM_BLOCKS, WIDTH, TAP_WIDTH = 4, 8, 4, 4 * 128
TABLE = torch.arange(NUM_BLOCKS).view(1, -1)  # one sequence's block table


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
            torch.tensor([ids]), torch.tensor([position]), TABLE
        )[0]


def test_context_rows_follow_the_spec(draft):
    gen = torch.Generator().manual_seed(1)
    taps, positions = torch.randn(3, TAP_WIDTH, generator=gen), torch.tensor([0, 5, 9])
    slots = torch.tensor([20, 21, 31])
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
    block = draft.block_forward(torch.tensor([42]), torch.tensor([6]), TABLE, 4)
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
    tables = TABLE.expand(2, -1)
    both = draft.block_forward(anchors, positions, tables, WIDTH)
    for b in range(2):
        one = draft.block_forward(
            anchors[b : b + 1], positions[b : b + 1], TABLE, WIDTH
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


def greedy_settings(num_seqs: int) -> SamplingMetadata:
    return SamplingMetadata.build([0.0] * num_seqs)


def test_markov_bias_flips_the_argmax_and_chains():
    head = small_head()
    # Previous token 0 favours 4; previous token 4 favours 2.
    head.markov_w1.weight[0] = torch.tensor([1.0, 0.0])
    head.markov_w1.weight[4] = torch.tensor([0.0, 1.0])
    head.markov_w2.weight[4] = torch.tensor([2.0, 0.0])
    head.markov_w2.weight[2] = torch.tensor([0.0, 2.0])
    base = torch.zeros(1, 2, 6)
    base[0, :, 1] = 1.0  # the backbone alone says 1 at both positions
    out = markov_decode(
        base, torch.tensor([0]), torch.tensor([3]), head.bias, greedy_settings(1)
    )
    assert out.ids.tolist() == [[4, 2]] and out.probs is None
    assert base[0].argmax(-1).tolist() == [1, 1]


def test_greedy_ties_take_the_lowest_index():
    out = markov_decode(
        torch.zeros(2, 3, 6),
        torch.tensor([0, 5]),
        torch.tensor([4, 9]),
        small_head().bias,
        greedy_settings(2),
    )
    assert out.ids.tolist() == [[0, 0, 0], [0, 0, 0]]


SAMPLED = dict(temperatures=[0.7, 1.0, 0.0], top_ks=[0, 50, 0], top_ps=[0.9, 1.0, 1.0])


def run_sampled(draft, base, anchors, positions, seeds, rows=None):
    rows = list(range(len(seeds))) if rows is None else rows
    settings = {k: [v[r] for r in rows] for k, v in SAMPLED.items()}
    sampling = SamplingMetadata.build(**settings, seeds=[seeds[r] for r in rows])
    return markov_decode(
        base[rows], anchors[rows], positions[rows], draft.markov_bias, sampling
    )


def test_sampled_q_is_the_exact_filtered_markov_distribution(draft):
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(3, 4, 4096, generator=gen)
    anchors, positions = torch.tensor([8, 900, 31]), torch.tensor([5, 17, 2])
    out = run_sampled(draft, base, anchors, positions, [11, 12, 13])
    again = run_sampled(draft, base, anchors, positions, [11, 12, 13])
    assert torch.equal(out.ids, again.ids) and torch.equal(out.probs, again.probs)
    prev = anchors
    for k in range(4):
        z = base[:, k] + draft.markov_bias(prev)
        expected = probs_for(z, *SAMPLED.values())
        assert torch.equal(out.probs[:, k], expected)  # row 2: one-hot of argmax
        assert bool((out.probs[:, k].gather(1, out.ids[:, k, None]) > 0).all())
        prev = out.ids[:, k]
    other = run_sampled(draft, base, anchors, positions, [21, 22, 13])
    assert not torch.equal(out.ids[:2], other.ids[:2])
    assert torch.equal(out.ids[2], other.ids[2])  # greedy: the seed is unused


def test_a_sequence_drafts_the_same_alone_and_in_a_batch(draft):
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(3, 4, 4096, generator=gen)
    anchors, positions = torch.tensor([8, 900, 31]), torch.tensor([5, 17, 2])
    batch = run_sampled(draft, base, anchors, positions, [11, 12, 13])
    for row in range(3):
        alone = run_sampled(draft, base, anchors, positions, [11, 12, 13], [row])
        assert torch.equal(alone.ids[0], batch.ids[row])
        if alone.probs is not None:  # None for the greedy row alone
            torch.testing.assert_close(alone.probs[0], batch.probs[row])


def test_sampled_drafts_follow_q():
    """Each position's draft is a draw from its q (Markov chain of one head)."""
    head = small_head(vocab=4)
    num_seqs = 4000
    base = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3])).expand(num_seqs, 2, 4)
    sampling = SamplingMetadata.build([1.0] * num_seqs, seeds=list(range(num_seqs)))
    out = markov_decode(
        base,
        torch.zeros(num_seqs, dtype=torch.long),
        torch.full((num_seqs,), 7),
        head.bias,
        sampling,
    )
    for k in range(2):
        counts = torch.bincount(out.ids[:, k], minlength=4).double()
        expected = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64) * num_seqs
        # chi-square, 3 degrees of freedom, 0.9999 quantile 21.11; fixed seeds.
        assert float(((counts - expected) ** 2 / expected).sum()) < 21.11
    # Positions 8 and 9 use different uniforms.
    assert not torch.equal(out.ids[:, 0], out.ids[:, 1])


def test_lengths_must_agree():
    with pytest.raises(ValueError, match="sampling metadata has 1 rows"):
        markov_decode(
            torch.zeros(2, 1, 6),
            torch.tensor([0, 1]),
            torch.tensor([3, 4]),
            small_head().bias,
            greedy_settings(1),
        )
    with pytest.raises(ValueError, match="anchor ids and positions"):
        markov_decode(
            torch.zeros(2, 1, 6),
            torch.tensor([0, 1]),
            torch.tensor([3]),
            small_head().bias,
            greedy_settings(2),
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
