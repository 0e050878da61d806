"""Tile choices of atom's grouped expert GEMM at a model's decode and prefill shapes.

For each batch size, the routed (token, expert) pairs of a random top-k routing are
sorted by expert, and both projections of the experts run through
`atom/kernels/expert_gemm.py` under every candidate `GemmTiles`: the gate/up
product reads the tokens' rows through the sort (fused gather), the down product
the sorted rows. Each call is timed as a CUDA graph replay (`bench_kernels.time_us`)
and reported as microseconds and as a fraction of the GPU's HBM bandwidth over the
bytes it must read (the used experts' weights) and as TFLOP/s (a prefill-sized
batch, thousands of tokens, is bound by the tensor cores instead). The default tiles
come first, then the five fastest candidates per projection and batch.

The shapes default to `bench_vs_transformers.py`'s issue10 preset (32 experts of
2304 x 1024, top 8, bf16).

    python benchmarks/tune_expert_gemm.py --batch-sizes 1,32,128
    python benchmarks/tune_expert_gemm.py --batch-sizes 8192  # 32 prompts of 256
"""

from __future__ import annotations

import argparse
import itertools

import torch
from bench_kernels import time_us
from hbm_peak import resolve_hbm_bytes_per_s

from atom.kernels.expert_gemm import GemmTiles, default_tiles, expert_gemm
from atom.model_ops.activation import GatedAct
from atom.model_ops.grouped_experts import align_to_experts


def candidates(block_m: int, rows_per_expert: float) -> list[GemmTiles]:
    """The grid searched. At decode shapes: the default's row tiles, narrower (more
    programs) and wider column tiles, deeper K slices, more warps and pipeline
    stages. At prefill shapes (hundreds of rows an expert): taller and wider tiles
    for the tensor cores, a smaller grid since each choice compiles anew."""
    if rows_per_expert < 128:
        grid = itertools.product(
            (block_m,), (32, 64, 128), (64, 128, 256), (4, 8), (3, 5)
        )
    else:
        grid = itertools.product((64, 128), (64, 128), (64,), (4, 8), (3, 4))
    return [GemmTiles(m, n, k, warps, stages) for m, n, k, warps, stages in grid]


def time_product(
    rows: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    source: torch.Tensor | None,
    act: GatedAct | None,
    tiles: GemmTiles,
    iters: int,
) -> float:
    return time_us(
        lambda: expert_gemm(rows, weight, ends, source, tiles, act=act), iters
    )


def tune(args: argparse.Namespace, batch: int, peak: float) -> None:
    dev, dtype = "cuda", torch.bfloat16
    experts, top_k, hidden, inner = args.experts, args.top_k, args.hidden, args.inner
    x = torch.randn(batch, hidden, device=dev, dtype=dtype)
    ids = torch.stack([torch.randperm(experts, device=dev)[:top_k] for _ in x])
    token_of, _, ends = align_to_experts(ids, experts)
    token_of = token_of.to(torch.int32)
    w13 = torch.randn(experts, 2 * inner, hidden, device=dev, dtype=dtype) / 50
    w2 = torch.randn(experts, hidden, inner, device=dev, dtype=dtype) / 30
    sorted_rows = torch.randn(token_of.numel(), inner, device=dev, dtype=dtype)
    used = int((ends.diff(prepend=ends.new_zeros(1)) > 0).sum())
    # The gate/up product as the MoE runs it (SiLU fused) and plain.
    products = {
        "w13 + SiLU (gather)": (x, w13, token_of, GatedAct("silu", 0.0, None)),
        "w13 (gather)": (x, w13, token_of, None),
        "w2": (sorted_rows, w2, None, None),
    }
    pairs = token_of.numel()
    for name, (rows, weight, source, act) in products.items():
        default = default_tiles(
            pairs, experts, dtype, False, x.device, gated=act is not None
        )
        choices = [default, *candidates(default.block_m, pairs / used)]
        moved = used * weight[0].numel() * weight.element_size()
        flops = 2 * pairs * weight[0].numel()
        timed = []
        for tiles in choices:
            try:
                us = time_product(rows, weight, ends, source, act, tiles, args.iters)
            except Exception as error:  # noqa: BLE001 - e.g. out of shared memory
                print(f"  {tiles}: failed ({type(error).__name__})")
                continue
            timed.append((us, tiles))
        default_us = timed[0][0]
        print(f"batch {batch:4d} {name}: {moved / 1e6:.1f} MB of experts")
        best = sorted(timed[1:], key=lambda entry: entry[0])[: args.top]
        for label, (us, tiles) in [("default", timed[0])] + [("", e) for e in best]:
            share = 100 * moved / (us * 1e-6) / peak
            print(
                f"  {label:8s}{us:8.1f} us ({default_us / us:4.2f}x) "
                f"{share:5.1f} % of HBM {flops / us / 1e6:6.1f} TFLOP/s  {tiles}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2304)
    parser.add_argument("--inner", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--hbm-tb-per-s", type=float, dest="hbm")
    args = parser.parse_args()
    peak = resolve_hbm_bytes_per_s(args.hbm)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    with torch.inference_mode():
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            tune(args, batch, peak)


if __name__ == "__main__":
    main()
