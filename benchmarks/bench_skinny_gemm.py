"""The skinny GEMM (`atom/kernels/skinny_gemm.py`) against cuBLAS at decode shapes.

Every dense product of `bench_vs_transformers.py`'s issue10 preset (bf16, tp 1) at
one and at eight rows (batch-1 decode and a DSpark verify of k = 7), and the two
fp32 products whose torch form is a cast and a cuBLAS GEMV. At more rows (`--rows
1,8,32,128`: decode batches) only the narrow products run, the ones the kernel
takes there. Per product it prints
microseconds per call for cuBLAS and for the kernel with `skinny_tiles`' choice
(CUDA graph replays, as decode runs), the fraction of the HBM rate the kernel
reaches reading W, and with `--sweep` the best of a grid of tiles beside it.

A replay of one product reads its weight from L2 after the first call when it fits
there (50 MB on an H100), which a decode step, reading 2 GB of weights a step, never
does. `--cold` cycles each call through enough copies of the weight to fill L2
four times over, so every call reads HBM as it does in a step.

    python benchmarks/bench_skinny_gemm.py --sweep
    python benchmarks/bench_skinny_gemm.py --cold --rows 1
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from bench_kernels import peak_rate, time_us

from atom.kernels.skinny_gemm import (
    SKINNY_MAX_ROWS,
    SkinnyTiles,
    skinny_linear,
    skinny_max_rows,
)

# name, N, K, weight dtype (None: the model's)
PRODUCTS = [
    ("kda qkv", 6144, 2304, None),
    ("kda f_a/g_a", 128, 2304, None),
    ("kda f_b/g_b", 2048, 128, None),
    ("o_proj", 2304, 2048, None),
    ("mla q_proj", 3072, 2304, None),
    ("mla kv_a", 576, 2304, None),
    ("shared gate_up", 2048, 2304, None),
    ("shared down", 2304, 1024, None),
    ("dense gate_up", 18432, 2304, None),
    ("dense down", 2304, 9216, None),
    ("lm head", 163840, 2304, None),
    ("kda b_proj", 16, 2304, torch.float32),
    ("router", 32, 2304, torch.float32),
]
SWEEP = [
    SkinnyTiles(block_n, block_k, 4 if block_n * block_k <= 4096 else 8)
    for block_n, block_k in itertools.product(
        [1, 2, 4, 8, 16, 32, 64], [64, 128, 256, 512, 1024, 2048]
    )
    if 256 <= block_n * block_k <= 16384
]


def weight_copies(nbytes: int, cold: bool) -> int:
    """How many copies of a weight of `nbytes` the timed calls cycle through: one
    warm, else enough to fill L2 four times (at most 512 launches a replay)."""
    if not cold:
        return 1
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(512, -(-4 * l2 // nbytes)))


def bench_product(
    name: str,
    rows: int,
    n: int,
    k: int,
    weight_dtype,
    iters: int,
    sweep: bool,
    cold: bool,
) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(rows, k, device=dev, dtype=bf16)
    dtype = weight_dtype or bf16
    copies = weight_copies(n * k * dtype.itemsize, cold)
    weights = [torch.randn(n, k, device=dev, dtype=dtype) for _ in range(copies)]
    weight = weights[0]
    out_dtype = weight.dtype

    def per_call(product) -> float:
        return time_us(lambda: [product(w) for w in weights], iters) / copies

    if weight_dtype is None:
        cublas = per_call(lambda w: F.linear(x, w))
    else:  # the torch form of a product against fp32 weights casts x first
        cublas = per_call(lambda w: F.linear(x.float(), w))

    def ours(tiles: SkinnyTiles | None = None) -> float:
        return per_call(lambda w: skinny_linear(x, w, None, out_dtype, tiles))

    chosen = ours()
    line = (
        f"{name:15s} rows {rows}: cuBLAS {cublas:7.1f} us"
        f" ({hbm_share(weight, cublas):5.1f} %), skinny {chosen:7.1f} us"
        f" ({cublas / chosen:4.2f}x) = {hbm_share(weight, chosen):5.1f} % of HBM"
    )
    if sweep:
        fits = [
            tiles
            for tiles in SWEEP
            if tiles.block_k <= max(64, 1 << (k - 1).bit_length())
            and min(rows, SKINNY_MAX_ROWS) * tiles.block_n * tiles.block_k <= 65536
        ]
        best_us, best = min(((ours(t), t) for t in fits), key=lambda pair: pair[0])
        line += (
            f"; best {best_us:7.1f} us ({hbm_share(weight, best_us):5.1f} %) "
            f"at n {best.block_n} k {best.block_k} warps {best.num_warps}"
        )
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also try every tiling")
    parser.add_argument(
        "--cold", action="store_true", help="read every weight from HBM (see above)"
    )
    args = parser.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        for name, n, k, weight_dtype in PRODUCTS:
            if rows > skinny_max_rows(n):
                continue
            bench_product(
                name, rows, n, k, weight_dtype, args.iters, args.sweep, args.cold
            )


def hbm_share(weight: torch.Tensor, us: float) -> float:
    return 100 * weight.numel() * weight.element_size() / (us * 1e-6) / peak_rate()


if __name__ == "__main__":
    main()
