"""y = x W^T (+ b) for a few rows of x, in Triton: the decode step's small products.

The torch reference is `torch.nn.functional.linear` in fp32. At one to a few rows a
small product is bound by latency, not bytes: cuBLAS spends a few microseconds on a
0.5 MB weight, and its fp32 GEMVs take a cast and two kernels more. Here each
program owns BLOCK_N output columns of up to SKINNY_MAX_ROWS rows, walks K in
BLOCK_K steps, and accumulates in fp32 with a broadcast multiply and a sum (no
tensor cores). A narrow product (the router's 32 columns, KDA's 16 write
strengths) takes up to NARROW_MAX_ROWS rows in blocks of SKINNY_MAX_ROWS: at a
large decode batch cuBLAS runs its fp32 form as a cast, a SIMT GEMM and a split-K
reduction, which took 1.4-2.4x this kernel's time at 32 and 128 rows on an H100
(`benchmarks/bench_skinny_gemm.py --rows 32,128`, 2026-12-06). Prefill-sized
products stay with cuBLAS, whose tiles read W once for many rows. x and W may
differ in dtype: the router's and KDA's write-strength products read bf16
activations against fp32 weights in one kernel. On large weights this form reads
W more slowly than cuBLAS (51 % of the HBM rate against 80 % on an H100), and at
eight rows its product tile spills; `model_ops/dense_product.py` gives it small
weights only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom.kernels import multiprocessors

# The rows one program holds, and the most a product of any width takes: decode at
# small batches and a DSpark verify of k = 7; beyond it cuBLAS's tiles read W once
# for many rows and win.
SKINNY_MAX_ROWS = 8
# Products of at most NARROW_MAX_COLUMNS columns take up to NARROW_MAX_ROWS rows
# (decode batches), a program per SKINNY_MAX_ROWS of them.
NARROW_MAX_COLUMNS = 64
NARROW_MAX_ROWS = 256
_MAX_BLOCK_N = 16
_TILE_ELEMENTS = 8192  # [rows, BLOCK_N, BLOCK_K] products a program holds at once


def skinny_max_rows(n: int) -> int:
    """The most rows an `n`-column product takes."""
    return NARROW_MAX_ROWS if n <= NARROW_MAX_COLUMNS else SKINNY_MAX_ROWS


def _row_blocks(rows: int) -> tuple[int, int]:
    """(BLOCK_M, row programs): the rows one program holds, padded to a power of
    two, and how many programs cover `rows`."""
    block_m = triton.next_power_of_2(max(1, min(rows, SKINNY_MAX_ROWS)))
    return block_m, triton.cdiv(max(1, rows), SKINNY_MAX_ROWS)


@dataclass(frozen=True)
class SkinnyTiles:
    block_n: int
    block_k: int
    num_warps: int


def skinny_tiles(rows: int, n: int, k: int, units: int) -> SkinnyTiles:
    """Tiles for an [rows, k] x [n, k]^T product on a GPU of `units` multiprocessors.

    BLOCK_N: the widest (up to 16) that still gives every unit two programs (over
    column and row blocks), so W streams from every unit at once; each program
    re-reads its rows of x, so x's share of the traffic is rows / BLOCK_N.
    BLOCK_K: row segments of 512 elements where one row of x is read (coalesced,
    few steps); with more rows the product tile [row block, BLOCK_N, BLOCK_K] stays
    within 8K elements of registers. A product too narrow for that (one column a
    program) reads up to 2048 of K a step instead: its programs are few, and each
    step is a round trip to memory."""
    span, row_blocks = _row_blocks(rows)
    block_n = _MAX_BLOCK_N
    while block_n > 1 and triton.cdiv(n, block_n) * row_blocks < 2 * units:
        block_n //= 2
    wide_k = triton.next_power_of_2(k)
    widest = _TILE_ELEMENTS // (span * block_n)
    block_k = min(wide_k, widest, 512 if block_n > 1 else 2048)
    block_k = max(32, block_k)
    warps = 4 if span * block_n * block_k <= _TILE_ELEMENTS // 2 else 8
    return SkinnyTiles(block_n, block_k, warps)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    rows,
    n,
    k,
    stride_x,
    stride_w,
    stride_out,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_ok, m_ok = cols < n, m < rows
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        k_ok = kk < k
        w = tl.load(
            w_rows + kk[None, :], mask=cols_ok[:, None] & k_ok[None, :], other=0
        )
        x = tl.load(
            x_ptr + m[:, None] * stride_x + kk[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0,
        )
        product = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        acc += tl.sum(product, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols_ok, other=0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + m[:, None] * stride_out + cols[None, :],
        acc,
        mask=m_ok[:, None] & cols_ok[None, :],
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    tiles: SkinnyTiles | None = None,
) -> torch.Tensor:
    """x [..., K] (at most `skinny_max_rows(N)` rows) times weight [N, K]^T (+ bias
    [N]), in `out_dtype` (x's by default), accumulated in fp32. `tiles` overrides
    the choice of `skinny_tiles` (the benchmark's sweep)."""
    k = x.shape[-1]
    n = weight.shape[0]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    if rows > skinny_max_rows(n):
        raise ValueError(
            f"skinny_linear takes up to {skinny_max_rows(n)} rows of a "
            f"{n}-column product, got {rows}"
        )
    if weight.shape[1] != k:
        raise ValueError(f"x [..., {k}] does not match weight {tuple(weight.shape)}")
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if tiles is None:
        tiles = skinny_tiles(rows, n, k, multiprocessors(x.device))
    block_m, row_blocks = _row_blocks(rows)
    _skinny_gemm_kernel[(triton.cdiv(n, tiles.block_n), row_blocks)](
        flat,
        weight,
        bias if bias is not None else weight,
        out,
        rows,
        n,
        k,
        flat.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
    )
    return out.view(*x.shape[:-1], n)
