"""Tile choices of KDA's short conv kernel (`atom/kernels/kda_conv.py`) at a prefill's
shape.

Each choice of `ConvTiles` convolves the same batch of fresh prompts (their rows a
strided view of a wider projection, as the KDA layer hands them over) and is timed
as a CUDA graph replay (`bench_kernels.time_us`); its output is first checked
against the torch reference (`kda_backend.torch_conv`). Reported: microseconds and
the share of the GPU's HBM bandwidth over the bytes the conv must move (its input
read once, its output written once), the default tiles first, then the fastest.

The shape defaults to `bench_vs_transformers.py`'s 2.6 B Kimi Linear (3 x 16 heads
of 128 channels, conv width 4) at a 16384-token prefill step of 64 prompts:

    python benchmarks/tune_kda_conv.py --batch 64 --rows 256
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from bench_kda_prefill import fresh_prompts
from bench_kernels import time_us
from hbm_peak import resolve_hbm_bytes_per_s

from atom.kernels.kda_conv import ConvTiles, default_conv_tiles, kda_conv_in_pool
from atom.model_ops.kda_backend import StateSlots, torch_conv


def candidates() -> list[ConvTiles]:
    grid = itertools.product((8, 16, 32, 64), (64, 128, 256), (4, 8))
    # Tiles beyond 16K elements spill the fp32 accumulator out of the registers.
    return [ConvTiles(r, c, w) for r, c, w in grid if r * c <= 16384]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--channels", type=int, default=3 * 16 * 128)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--hbm-tb-per-s", type=float, default=None)
    args = parser.parse_args()
    peak = resolve_hbm_bytes_per_s(args.hbm_tb_per_s)
    dev, dtype = "cuda", torch.bfloat16
    batch, rows, channels = args.batch, args.rows, args.channels
    metadata = fresh_prompts(batch, rows, dev)
    # The layer's projection is wider than the conv's channels: strided rows.
    projected = torch.randn(batch, rows, channels + 512, device=dev, dtype=dtype)
    mixed = projected[..., :channels]
    weight = torch.randn(channels, args.width, device=dev, dtype=dtype) / 2
    pool = torch.zeros(batch, channels, args.width - 1, device=dev, dtype=dtype)
    slots = torch.arange(batch, device=dev)
    context_lens = torch.zeros(batch, dtype=torch.int32, device=dev)
    reference = torch_conv(
        mixed, weight, StateSlots(pool.clone(), slots, context_lens), metadata
    )

    def conv(tiles: ConvTiles) -> torch.Tensor:
        return kda_conv_in_pool(
            mixed,
            weight,
            pool,
            slots,
            context_lens,
            metadata.query_start_loc,
            None,
            tiles,
        )

    moved = 2 * mixed.numel() * mixed.element_size()
    print(
        f"## kda conv: {batch} x {rows} rows of {channels} channels, width "
        f"{args.width}, bf16; {moved / 1e6:.1f} MB moved; HBM {peak / 1e12:.2f} TB/s"
    )
    default = default_conv_tiles(rows, channels)
    timed = []
    # Each line as it is timed (every choice compiles anew), the fastest last.
    for label, tiles in [("default", default)] + [
        ("candidate", tiles) for tiles in candidates()
    ]:
        torch.testing.assert_close(conv(tiles), reference, rtol=2e-2, atol=2e-2)
        us = time_us(functools.partial(conv, tiles), args.iters)
        timed.append((us, tiles))
        print(f"{label:9s} {describe(tiles, us, moved, peak)}", flush=True)
    for us, tiles in sorted(timed, key=lambda pair: pair[0])[: args.top]:
        print(f"fastest   {describe(tiles, us, moved, peak)}")


def describe(tiles: ConvTiles, us: float, moved: int, peak: float) -> str:
    return (
        f"rows {tiles.block_rows:3d} x channels {tiles.block_channels:3d}, "
        f"{tiles.num_warps} warps: {us:9.1f} us, "
        f"{moved / (us * 1e-6) / peak * 100:5.1f} % of HBM"
    )


if __name__ == "__main__":
    main()
