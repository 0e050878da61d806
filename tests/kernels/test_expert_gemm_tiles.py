"""The grouped expert GEMM gives the same product under any `GemmTiles`: the tile
shapes and pipelining `benchmarks/tune_expert_gemm.py` times (interpreted on CPU,
natively on CUDA)."""

import pytest
import torch
import torch.nn.functional as F

from atom.kernels import triton_available
from atom.model_ops.grouped_experts import align_to_experts
from tests.kernels.devices import DEVICES, half_dtype


def grouped_reference(x, weight, token_of, ends):
    """The grouped product in fp32: each expert's sorted rows times its weight."""
    expected = torch.empty(token_of.numel(), weight.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        rows = x[token_of[start:end]].float()
        expected[start:end] = F.linear(rows, weight[expert].float())
        start = end
    return expected


def tile_choices():
    from atom.kernels.expert_gemm import GemmTiles

    return [
        None,  # default_tiles
        # fp32 operands: each fits the 227 KiB of shared memory of an sm90 SM.
        GemmTiles(16, 32, 32, num_warps=2, num_stages=2),
        GemmTiles(32, 128, 64, num_warps=8, num_stages=3),
        GemmTiles(64, 64, 128, num_warps=4, num_stages=2),
    ]


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 23])
@pytest.mark.parametrize("choice", range(4))
def test_every_tile_choice_gives_the_grouped_product(device, tokens, choice):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.expert_gemm import expert_gemm

    gen = torch.Generator().manual_seed(tokens)
    # Widths off every tile size: the masks of N and K are exercised.
    experts, top_k, n, k = 6, 2, 72, 40
    ids = torch.stack(
        [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
    )
    token_of, _, ends = align_to_experts(ids, experts)
    x = torch.randn(tokens, k, generator=gen)
    weight = torch.randn(experts, n, k, generator=gen) / k**0.5
    expected = grouped_reference(x, weight, token_of, ends)
    out = expert_gemm(
        x.to(device),
        weight.to(device),
        ends.to(device),
        token_of.to(device=device, dtype=torch.int32),
        tiles=tile_choices()[choice],
    )
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_sized_groups_take_the_prefill_tiles_and_give_the_product(device):
    """A prompt's worth of rows per expert in half precision: the default tiles are
    the tall prefill ones wherever their shared memory fits, and they give the
    grouped product (groups shorter and longer than one 128-row tile, widths off the
    tile sizes)."""
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    dtype = half_dtype(device)
    from atom.kernels.expert_gemm import (
        PREFILL_ROWS_PER_EXPERT,
        PREFILL_TILES,
        default_tiles,
        expert_gemm,
        shared_memory_bytes,
    )

    gen = torch.Generator().manual_seed(0)
    experts, top_k, n, k = 3, 2, 136, 72
    tokens = PREFILL_ROWS_PER_EXPERT * experts // top_k + 5
    fits = True
    if device == "cuda":
        props = torch.cuda.get_device_properties(device)
        fits = (
            shared_memory_bytes(PREFILL_TILES, 2, False)
            <= props.shared_memory_per_block_optin
        )
    tiles = default_tiles(tokens * top_k, experts, dtype, False, torch.device(device))
    assert (tiles == PREFILL_TILES) == fits
    # Uneven groups: expert 0 takes every token, experts 1 and 2 share the rest.
    ids = torch.stack([torch.tensor([0, 1 + t % 2]) for t in range(tokens)])
    token_of, _, ends = align_to_experts(ids, experts)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    weight = (torch.randn(experts, n, k, generator=gen) / k**0.5).to(dtype)
    expected = grouped_reference(x, weight, token_of, ends)
    out = expert_gemm(
        x.to(device),
        weight.to(device),
        ends.to(device),
        token_of.to(device=device, dtype=torch.int32),
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated", [False, True])
def test_decode_tiles_take_128_deep_slices_in_half_precision(device, gated):
    """A decode-sized half-precision step (16-row tiles) walks K in 128-deep slices,
    and K of one full slice plus a remainder still gives the product."""
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.expert_gemm import default_tiles, expert_gemm
    from atom.model_ops.activation import GatedAct

    dtype = half_dtype(device)
    experts, top_k, inner, k, tokens = 4, 2, 40, 200, 3
    tiles = default_tiles(tokens * top_k, experts, dtype, False, torch.device(device))
    assert (tiles.block_m, tiles.block_k) == (16, 128)
    gen = torch.Generator().manual_seed(2)
    ids = torch.stack(
        [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
    )
    token_of, _, ends = align_to_experts(ids, experts)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    weight = (torch.randn(experts, 2 * inner, k, generator=gen) / k**0.5).to(dtype)
    expected = grouped_reference(x, weight, token_of, ends)
    act = GatedAct("silu", 0.0, None) if gated else None
    if gated:
        expected = gated_reference(expected, "silu", 0.0, None)
    out = expert_gemm(
        x.to(device),
        weight.to(device),
        ends.to(device),
        token_of.to(device=device, dtype=torch.int32),
        act=act,
    )
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_the_prefill_tiles_stage_96_kib_in_half_precision():
    """Three stages of a 128-row and a 128-column tile, 64 deep: more than a ROCm
    CU's 64 KiB, within a Hopper SM's 227 KiB."""
    from atom.kernels.expert_gemm import PREFILL_TILES, shared_memory_bytes

    assert shared_memory_bytes(PREFILL_TILES, 2, False) == 96 * 1024


GATED = [
    ("silu", 0.0, None),
    ("situ", 2.0, 3.0),
    ("situ", 1.5, None),
    ("swiglu_oai", 1.702, 0.5),
]


def gated_reference(product, name, p0, p1):
    """The activation modules' torch definitions over an fp32 [M, 2I] product."""
    from atom.model_ops.activation import SiluAndMul, SiTUAndMul, SwigluOAIAndMul

    module = {
        "silu": lambda: SiluAndMul(),
        "situ": lambda: SiTUAndMul(p0, p1),
        "swiglu_oai": lambda: SwigluOAIAndMul(p0, p1),
    }[name]()
    return module.reference(product)


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("act", GATED)
def test_the_fused_activation_is_the_activated_product(device, tokens, act):
    """The gate/up product finished with the activation in the kernel: [M, I] equal
    to the activation of the [M, 2I] product, in fp32 and half precision, for each
    activation the kernels know (widths off the tile sizes)."""
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.expert_gemm import expert_gemm
    from atom.model_ops.activation import GatedAct

    gen = torch.Generator().manual_seed(tokens)
    experts, top_k, inner, k = 5, 2, 36, 40
    ids = torch.stack(
        [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
    )
    token_of, _, ends = align_to_experts(ids, experts)
    x = torch.randn(tokens, k, generator=gen)
    weight = torch.randn(experts, 2 * inner, k, generator=gen) / k**0.5
    for dtype, tol in ((torch.float32, 1e-4), (half_dtype(device), 2e-2)):
        rows, w = x.to(dtype), weight.to(dtype)
        expected = gated_reference(grouped_reference(rows, w, token_of, ends), *act)
        out = expert_gemm(
            rows.to(device),
            w.to(device),
            ends.to(device),
            token_of.to(device=device, dtype=torch.int32),
            act=GatedAct(*act),
        )
        assert out.shape == (tokens * top_k, inner) and out.dtype == dtype
        torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
def test_the_fused_activation_at_prefill_tiles(device):
    """Prefill-sized groups in half precision take the gated prefill tiles (two
    64-column accumulators) and still give the activated product."""
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.expert_gemm import (
        PREFILL_ROWS_PER_EXPERT,
        default_tiles,
        expert_gemm,
        shared_memory_bytes,
    )
    from atom.model_ops.activation import GatedAct

    dtype = half_dtype(device)
    experts, inner, k = 2, 72, 48
    tokens = PREFILL_ROWS_PER_EXPERT * experts + 3
    tiles = default_tiles(tokens, experts, dtype, False, torch.device(device), True)
    assert (tiles.block_m, tiles.block_n) in ((128, 64), (16, 32), (64, 32))
    assert shared_memory_bytes(tiles, 2, True) <= 96 * 1024
    gen = torch.Generator().manual_seed(1)
    ids = torch.tensor([[t % experts] for t in range(tokens)])
    token_of, _, ends = align_to_experts(ids, experts)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    weight = (torch.randn(experts, 2 * inner, k, generator=gen) / k**0.5).to(dtype)
    expected = gated_reference(
        grouped_reference(x, weight, token_of, ends), "silu", 0.0, None
    )
    out = expert_gemm(
        x.to(device),
        weight.to(device),
        ends.to(device),
        token_of.to(device=device, dtype=torch.int32),
        act=GatedAct("silu", 0.0, None),
    )
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2, rtol=2e-2)
