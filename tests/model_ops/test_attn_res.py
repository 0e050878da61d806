import torch

from atom.model_ops.attn_res import attn_res_mix, attn_res_mix_norm
from atom.model_ops.layernorm import RMSNorm


def random_weights(hidden, seed=0):
    gen = torch.Generator().manual_seed(seed)
    norm = 1 + 0.1 * torch.randn(hidden, generator=gen)
    proj = torch.randn(1, hidden, generator=gen)
    return norm, proj


def test_no_bank_returns_partial_exactly():
    partial = torch.randn(3, 8).bfloat16()
    norm, proj = random_weights(8)
    assert attn_res_mix(None, partial, norm, proj, 1e-5) is partial
    empty = torch.zeros(3, 0, 8).bfloat16()
    assert torch.equal(attn_res_mix(empty, partial, norm, proj, 1e-5), partial)


def test_equal_scores_give_the_mean():
    gen = torch.Generator().manual_seed(1)
    bank = torch.randn(4, 2, 8, generator=gen)
    partial = torch.randn(4, 8, generator=gen)
    norm, _ = random_weights(8)
    zero_proj = torch.zeros(8)  # every score 0 -> uniform weights
    mix = attn_res_mix(bank, partial, norm, zero_proj, 1e-5)
    expected = (bank.sum(dim=1) + partial) / 3
    torch.testing.assert_close(mix, expected)


def test_identical_candidates_mix_to_themselves():
    partial = torch.randn(2, 8)
    bank = partial.unsqueeze(1).expand(2, 3, 8)
    norm, proj = random_weights(8, seed=2)
    torch.testing.assert_close(attn_res_mix(bank, partial, norm, proj, 1e-5), partial)


def test_matches_hand_computation():
    gen = torch.Generator().manual_seed(3)
    hidden, eps = 6, 1e-5
    bank = torch.randn(2, 2, hidden, generator=gen) * 3
    partial = torch.randn(2, hidden, generator=gen)
    norm, proj = random_weights(hidden, seed=4)
    mix = attn_res_mix(bank, partial, norm, proj, eps)
    for t in range(2):
        candidates = [bank[t, 0], bank[t, 1], partial[t]]
        scores = []
        for c in candidates:
            rms = (sum(float(x) ** 2 for x in c) / hidden + eps) ** 0.5
            scores.append(
                sum(float(c[d] * norm[d] * proj[0, d]) for d in range(hidden)) / rms
            )
        top = max(scores)
        exps = [2.718281828459045 ** (s - top) for s in scores]
        alphas = [e / sum(exps) for e in exps]
        expected = sum(a * c for a, c in zip(alphas, candidates))
        torch.testing.assert_close(mix[t], expected, rtol=1e-5, atol=1e-5)


def test_returns_partial_dtype_and_accumulates_in_fp32():
    gen = torch.Generator().manual_seed(5)
    bank = torch.randn(3, 2, 16, generator=gen).bfloat16()
    partial = torch.randn(3, 16, generator=gen).bfloat16()
    norm, proj = random_weights(16, seed=6)
    mix = attn_res_mix(bank, partial, norm.bfloat16(), proj.bfloat16(), 1e-5)
    assert mix.dtype == torch.bfloat16
    reference = attn_res_mix(
        bank.float(),
        partial.float(),
        norm.bfloat16().float(),
        proj.bfloat16().float(),
        1e-5,
    )
    torch.testing.assert_close(mix, reference.bfloat16(), rtol=0, atol=0)


def test_rejects_mismatched_bank():
    norm, proj = random_weights(8)
    try:
        attn_res_mix(torch.zeros(2, 1, 7), torch.zeros(2, 8), norm, proj, 1e-5)
    except ValueError as err:
        assert "bank" in str(err)
    else:
        raise AssertionError("a bank of the wrong width must be rejected")


def test_mix_norm_is_the_norm_of_the_mix():
    gen = torch.Generator().manual_seed(7)
    bank = torch.randn(3, 2, 8, generator=gen)
    partial = torch.randn(3, 8, generator=gen)
    norm, proj = random_weights(8, seed=8)
    out_norm = RMSNorm(8, eps=1e-5)
    out_norm.weight.data = torch.rand(8, generator=gen) + 0.5
    mixed = attn_res_mix_norm(bank, partial, norm, proj, 1e-5, out_norm)
    torch.testing.assert_close(
        mixed, out_norm(attn_res_mix(bank, partial, norm, proj, 1e-5))
    )
    alone = attn_res_mix_norm(None, partial, norm, proj, 1e-5, out_norm)
    torch.testing.assert_close(alone, out_norm(partial))
