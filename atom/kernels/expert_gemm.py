"""Grouped expert GEMM in Triton: rows sorted by expert times that expert's weight.

The torch reference is `atom.model_ops.grouped_experts._grouped_linear`. Rows
arrive sorted by expert (group e is rows [start_e, end_e)); each program multiplies
one tile of BLOCK_M rows of one group by one BLOCK_N slice of that expert's weight.
The tile list is built on the device from the group sizes with a fixed upper bound
on its length (ceil(M / BLOCK_M) + min(E, M) tiles: each group holding a row adds
at most one partial tile), so nothing is read back to the host and
a CUDA graph can capture the whole product in any dtype. Tiles past the real count
exit at once. The first GEMM of an expert MLP reads its rows through `row_source`
(the token each sorted row belongs to), which fuses the gather of the inputs.

`fp8_expert_gemm` runs the same tiles on e4m3 codes: rows quantized per token
(`atom/kernels/fp8_quant.py`) and weights per output channel, each with fp32
scales. On sm89+ NVIDIA GPUs the dot reads the e4m3 operands as they are; elsewhere
(older GPUs, ROCm) the kernel decodes the codes to fp16, which holds every e4m3
value exactly, and multiplies those. The scales apply once, after the K loop.

The gate/up product may finish with the gated activation (`GatedAct`): each
program then reads the gate rows and the matching up rows of its columns, keeps two
accumulators and writes act(gate) * up, [M, I] instead of [M, 2I]. The activation
kernel between the two products and the wide intermediate's round trip through
memory go away, and the activation reads fp32 sums, not rounded ones.

`GemmTiles` is a launch's tile shape and pipelining. `default_tiles` chooses it
from the rows per expert, the operand type and the device's shared memory;
`benchmarks/tune_expert_gemm.py` times other choices at a model's shapes on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from atom.kernels import rows_per_chunk
from atom.kernels.gated_act import ACTIVATIONS, gated_activation
from atom.utils.arithmetic import ceil_div

if TYPE_CHECKING:
    from atom.model_ops.activation import GatedAct


@triton.jit
def _e4m3_to_fp16(code_bits):
    """fp16 values of e4m3 bit patterns (uint8): the 7 value bits shifted under
    fp16's exponent read as the value times 2^-8 (the biases differ by 8), subnormal
    codes included; times 256 is exact."""
    bits = code_bits.to(tl.int32)
    half = ((bits & 0x7F) << 7) | ((bits & 0x80) << 8)
    return half.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _accumulate(
    a,
    w,
    acc,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
    DECODE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if DECODE:
        a = _e4m3_to_fp16(a)
        w = _e4m3_to_fp16(w)
    if IEEE:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    elif FP8 and not DECODE:
        # Hopper's fp8 MMA accumulates with reduced precision: fold each
        # BLOCK_K slice into the fp32 accumulator, as cuBLAS's fp8 GEMM does.
        acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _expert_gemm_kernel(
    a_ptr,
    row_source_ptr,
    w_ptr,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    group_end_ptr,
    num_experts,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    p0,
    p1,
    GATHER: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
    DECODE: tl.constexpr,
    ACT: tl.constexpr,
    HAS_P1: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # ACT >= 0: N is the activation's width I, and the up rows sit N rows below
    # the gate rows of each expert's [2I, K] weight.
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= num_experts:
        return
    first_row = tl.load(tile_row_ptr + tile)
    group_end = tl.load(group_end_ptr + expert)
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < group_end
    if GATHER:
        a_rows = tl.load(row_source_ptr + rows, mask=row_ok, other=0)
    else:
        a_rows = rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ACT >= 0:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = tl.load(
            a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        # w is [N, K] per expert: load the [BLOCK_K, BLOCK_N] transpose tile.
        w_cols = w_tile + cols[None, :] * stride_wn + k[:, None]
        w_ok = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_cols, mask=w_ok, other=0.0)
        acc = _accumulate(a, w, acc, IEEE, FP8, DECODE, BLOCK_K)
        if ACT >= 0:
            w_up = tl.load(w_cols + N * stride_wn, mask=w_ok, other=0.0)
            acc_up = _accumulate(a, w_up, acc_up, IEEE, FP8, DECODE, BLOCK_K)
    if FP8:
        a_scale = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)[:, None]
        scale_rows = 2 * N if ACT >= 0 else N
        w_scales = w_scale_ptr + expert * scale_rows + cols
        acc *= a_scale * tl.load(w_scales, mask=col_ok, other=0.0)[None, :]
        if ACT >= 0:
            acc_up *= a_scale * tl.load(w_scales + N, mask=col_ok, other=0.0)[None, :]
    if ACT >= 0:
        acc = gated_activation(acc, acc_up, p0, p1, ACT, HAS_P1)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(
        out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :]
    )


# Tile height -> (expert of each tile, first sorted row of each tile), built from one
# step's groups (`expert_tiles_triton`).
TileLists = dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class GemmTiles:
    """BLOCK_M x BLOCK_N output tiles over BLOCK_K slices, with Triton's num_warps
    and num_stages (software-pipelined loads) for the launch."""

    block_m: int
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# Rows per expert, on average, from which a half-precision product is prefill-sized:
# bound by the tensor cores rather than by reading the weights.
PREFILL_ROWS_PER_EXPERT = 128
# Tall, wide tiles for those products: each K slice of an expert's weight then
# serves 128 rows, and 8 warps keep the tensor cores fed.
PREFILL_TILES = GemmTiles(128, 128, 64, num_warps=8, num_stages=3)


def shared_memory_bytes(tiles: GemmTiles, element_size: int, gated: bool) -> int:
    """Shared memory a launch stages: one row tile and one weight tile (two when
    the activation is fused: gate and up) per stage."""
    weight_cols = tiles.block_n * (2 if gated else 1)
    per_stage = (tiles.block_m + weight_cols) * tiles.block_k * element_size
    return tiles.num_stages * per_stage


@functools.cache
def _device_shared_memory(device: torch.device) -> int | None:
    """The most shared memory one program may opt into on `device`; None where
    there is no such limit (Triton's interpreter on the CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def decode_block_m(num_rows: int, num_experts: int) -> int:
    """The tile height of a product below prefill size: few rows per expert
    (decode) waste less of a small tile."""
    return 16 if num_rows <= 4 * num_experts else 64


def default_tiles(
    num_rows: int,
    num_experts: int,
    dtype: torch.dtype,
    fp8: bool,
    device: torch.device,
    gated: bool = False,
) -> GemmTiles:
    """The tiles of a product over `num_rows` sorted rows and `num_experts` groups
    on `device`; `gated`: the product fuses the activation, so each program reads
    gate and up columns and holds two accumulators (half as many columns each)."""
    half = dtype in (torch.bfloat16, torch.float16) and not fp8
    block_n = 32 if gated else 64
    if half and num_rows >= PREFILL_ROWS_PER_EXPERT * num_experts:
        tiles = PREFILL_TILES
        if gated:  # the two accumulators hold what one 128-column tile did
            tiles = GemmTiles(128, 64, 64, num_warps=8, num_stages=3)
        # 96 KiB fits a Hopper SM but not every GPU (a ROCm CU has 64 KiB).
        limit = _device_shared_memory(device)
        needed = shared_memory_bytes(tiles, dtype.itemsize, gated)
        if limit is None or needed <= limit:
            return tiles
    # A fused activation's narrower tiles keep as many programs streaming the
    # weights.
    block_m = decode_block_m(num_rows, num_experts)
    # With 16-row tiles each program's loads are mostly weight: 128-deep K slices
    # keep more of them in flight (1.07x on gate/up and 1.10x on down at one token
    # on an H100, `benchmarks/tune_expert_gemm.py`), in 60 KiB of shared memory.
    if half and block_m == 16:
        deep = GemmTiles(block_m, block_n, 128)
        limit = _device_shared_memory(device)
        if limit is None or shared_memory_bytes(deep, dtype.itemsize, gated) <= limit:
            return deep
    block_k = 128 if fp8 else 32 if dtype == torch.float32 else 64
    return GemmTiles(block_m, block_n, block_k)


def tile_bound(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most tiles `num_rows` sorted rows in `num_experts` groups can take: the
    full tiles, plus one partial tile for each group that holds a row. At a decode
    step of one token (8 rows, 32 experts) that is 9 tiles, not 33: the GEMM's grid
    holds fewer programs that only exit."""
    return ceil_div(num_rows, block_m) + min(num_experts, num_rows)


@triton.jit
def store_tile_list(
    starts,
    ends,
    real,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Write the tile list of groups [starts, ends) ([BLOCK_E] blocks, `real` the
    experts that exist): each tile's expert and first sorted row, for `num_tiles`
    tiles (`tile_bound`)."""
    experts = tl.arange(0, starts.shape[0])
    tiles_of = (ends - starts + BLOCK_M - 1) // BLOCK_M
    # Padding experts end after every tile, so no tile counts them.
    tile_ends = tl.where(real, tl.cumsum(tiles_of, axis=0), 2147483647)
    first_tile = tile_ends - tiles_of
    tiles = tl.arange(0, BLOCK_T)
    for first in range(0, num_tiles, BLOCK_T):
        tile = first + tiles
        # A tile's expert: the number of experts whose tiles end at or before it
        # (the number of experts for the padding tiles past the last real one).
        expert = tl.sum((tile_ends[None, :] <= tile[:, None]).to(tl.int32), axis=1)
        mine = experts[None, :] == expert[:, None]
        row = tl.sum(tl.where(mine, starts - first_tile * BLOCK_M, 0), axis=1)
        inside = tile < num_tiles
        tl.store(tile_expert_ptr + tile, expert, mask=inside)
        tl.store(tile_row_ptr + tile, row + tile * BLOCK_M, mask=inside)


@triton.jit
def _tiles_kernel(
    group_end_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_experts,
    num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    ends = tl.load(group_end_ptr + experts, mask=real, other=0)
    starts = tl.load(group_end_ptr + experts - 1, mask=real & (experts > 0), other=0)
    store_tile_list(
        starts, ends, real, tile_expert_ptr, tile_row_ptr, num_tiles, BLOCK_M, BLOCK_T
    )


def expert_tiles_triton(
    group_ends: torch.Tensor, num_rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_tiles` in one launch; a padding tile's row is unspecified (unread)."""
    num_experts = group_ends.numel()
    num_tiles = tile_bound(num_rows, num_experts, block_m)
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=group_ends.device)
    tile_row = torch.empty_like(tile_expert)
    block_e = triton.next_power_of_2(num_experts)
    _tiles_kernel[(1,)](
        group_ends,
        tile_expert,
        tile_row,
        num_experts,
        num_tiles,
        BLOCK_M=block_m,
        BLOCK_T=rows_per_chunk(block_e),
        BLOCK_E=block_e,
    )
    return tile_expert, tile_row


def expert_tiles(
    group_ends: torch.Tensor, num_rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert of each tile, first sorted row of each tile), padded to the fixed
    bound `tile_bound` with expert = E (no work). The torch
    reference of `expert_tiles_triton`, which the GEMMs use: one launch instead of
    about ten."""
    num_experts = group_ends.numel()
    ends = group_ends.long()
    counts = ends.diff(prepend=ends.new_zeros(1))
    tiles_per_expert = ceil_div(counts, block_m)
    tile_ends = tiles_per_expert.cumsum(0)
    max_tiles = tile_bound(num_rows, num_experts, block_m)
    tile = torch.arange(max_tiles, device=ends.device)
    expert = torch.searchsorted(tile_ends, tile, right=True)
    known = expert.clamp(max=num_experts - 1)
    first_tile = tile_ends[known] - tiles_per_expert[known]
    first_row = (ends[known] - counts[known]) + (tile - first_tile) * block_m
    return expert.to(torch.int32), first_row.to(torch.int32)


def _launch(
    rows: torch.Tensor,
    weight: torch.Tensor,
    group_ends: torch.Tensor,
    row_source: torch.Tensor | None,
    out: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    decode: bool = False,
    tiles: GemmTiles | None = None,
    tile_lists: TileLists | None = None,
    act: GatedAct | None = None,
) -> torch.Tensor:
    """Fill `out` [M, N] with the grouped product ([M, N/2] through `act`);
    `scales` (row scales [rows, 1], weight scales [E, N, 1]) mark fp8 operands,
    which `decode` reads as bits; `tiles` None takes `default_tiles`; `tile_lists`
    keeps the tile list built from these groups for the next product over them."""
    num_rows = out.shape[0]
    num_experts, n, k = weight.shape
    if act is not None:
        if n % 2:
            raise ValueError(f"a gated product needs [gate | up] rows, got {n}")
        n //= 2
    if num_rows == 0:
        return out
    if tiles is None:
        tiles = default_tiles(
            num_rows,
            num_experts,
            rows.dtype,
            scales is not None,
            rows.device,
            gated=act is not None,
        )
    group_ends = group_ends.to(torch.int32)
    tile_lists = {} if tile_lists is None else tile_lists
    if tiles.block_m not in tile_lists:
        tile_lists[tiles.block_m] = expert_tiles_triton(
            group_ends, num_rows, tiles.block_m
        )
    tile_expert, tile_row = tile_lists[tiles.block_m]
    if decode:
        # Triton has no e4m3 type on these devices: pass the bits.
        rows, weight = rows.view(torch.uint8), weight.view(torch.uint8)
    a_scale, w_scale = scales if scales is not None else (out, out)
    grid = (tile_expert.numel(), triton.cdiv(n, tiles.block_n))
    _expert_gemm_kernel[grid](
        rows,
        row_source if row_source is not None else tile_row,
        weight,
        out,
        a_scale,
        w_scale,
        tile_expert,
        tile_row,
        group_ends,
        num_experts,
        n,
        k,
        rows.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        act.p0 if act is not None else 0.0,
        act.p1 if act is not None and act.p1 is not None else 1.0,
        GATHER=row_source is not None,
        IEEE=rows.dtype == torch.float32,
        FP8=scales is not None,
        DECODE=decode,
        ACT=ACTIVATIONS[act.name] if act is not None else -1,
        HAS_P1=act is not None and act.p1 is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def expert_gemm(
    rows: torch.Tensor,
    weight: torch.Tensor,
    group_ends: torch.Tensor,
    row_source: torch.Tensor | None = None,
    tiles: GemmTiles | None = None,
    tile_lists: TileLists | None = None,
    act: GatedAct | None = None,
) -> torch.Tensor:
    """out [M, N] with out[r] = rows[src(r)] @ weight[e(r)].T, in rows' dtype; with
    `act`, [M, N/2]: act(gate) * up of that product's two halves.

    weight [E, N, K]; group_ends [E] int (cumulative group sizes over the M sorted
    rows); row_source [M] the row of `rows` each sorted row reads (None: itself).
    fp32 operands multiply in full fp32 (no tf32) so fp32 models stay exact.
    `tile_lists`, shared by the products over one set of groups, builds their tile
    list once.
    """
    num_rows = row_source.shape[0] if row_source is not None else rows.shape[0]
    rows = rows.contiguous()
    width = weight.shape[1] // (2 if act is not None else 1)
    out = rows.new_empty(num_rows, width)
    return _launch(
        rows,
        weight.contiguous(),
        group_ends,
        row_source,
        out,
        tiles=tiles,
        tile_lists=tile_lists,
        act=act,
    )


def fp8_dot_native(device: torch.device) -> bool:
    """Whether Triton's dot takes e4m3 operands on `device`: NVIDIA sm89+ and the
    interpreter. ROCm GPUs decode instead: their fp8 formats differ by chip."""
    if device.type == "cpu":
        return True
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_expert_gemm(
    codes: torch.Tensor,
    row_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group_ends: torch.Tensor,
    row_source: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    decode: bool | None = None,
    tile_lists: TileLists | None = None,
    act: GatedAct | None = None,
) -> torch.Tensor:
    """`expert_gemm` of e4m3 operands: out[r] = (codes[src(r)] * row_scale[src(r)])
    @ (weight[e] * weight_scale[e]).T, in `out_dtype` (through `act` as
    `expert_gemm` applies it).

    codes [rows, K] and row_scale [rows, 1] as `quantize_rows` gives them; weight
    [E, N, K] e4m3 with weight_scale [E, N, 1] fp32. `decode` forces the fp16
    decoding (True) or the e4m3 dot (False); None picks by device (module docstring).
    `tile_lists` as `expert_gemm` takes it.
    """
    num_rows = row_source.shape[0] if row_source is not None else codes.shape[0]
    if decode is None:
        decode = not fp8_dot_native(codes.device)
    width = weight.shape[1] // (2 if act is not None else 1)
    out = torch.empty(num_rows, width, dtype=out_dtype, device=codes.device)
    scales = (row_scale.contiguous(), weight_scale.contiguous())
    return _launch(
        codes.contiguous(),
        weight.contiguous(),
        group_ends,
        row_source,
        out,
        scales,
        decode,
        tile_lists=tile_lists,
        act=act,
    )
