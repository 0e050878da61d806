"""Where a KDA prefill should leave the decode kernels for fla's chunked kernels.

The triton KDA backend (`atom/model_ops/kda_backend.py`) runs small prefills
(`TritonKDABackend.runs_as_decode`) through its decode kernels, row by row in the
state pools, and larger ones through fla's chunked KDA. This times one layer's
recurrence both ways (the short conv with its state gather and scatter, then the
KDA recurrence with its own), wall clock of eager calls as a prefill step runs
them, host included, for fresh prompts of each length:

    python benchmarks/bench_kda_prefill.py --rows 16,32,64,128,256 --batch-sizes 1,8

Shapes: `HEADSxDIM` per `--shapes` (4x32 is tiny-kimi-k3, 16x128 the 2.6 B Kimi
Linear of bench_vs_transformers.py), conv width 4, bf16 activations.
"""

from __future__ import annotations

import argparse
import time

import torch

from atom.model_engine.batch import SeqWork
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_ops.kda import causal_conv1d, l2_normalize
from atom.model_ops.kda_backend import StateSlots, select_kda_backend


def fresh_prompts(batch: int, rows: int, device: str):
    works = [
        SeqWork(
            seq_id=i,
            token_ids=[0] * rows,
            context_len=0,
            block_table=list(range(-(-rows // 16))),
            state_slot=i,
        )
        for i in range(batch)
    ]
    return prepare_inputs(works, 16, device)[2]


def wall_us(call, iters: int) -> float:
    call()
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def measure(heads: int, dim: int, batch: int, rows: int, iters: int) -> tuple:
    device = "cuda"
    backend = select_kda_backend(device, "triton")
    metadata = fresh_prompts(batch, rows, device)
    gen = torch.Generator(device=device).manual_seed(rows)
    width = heads * dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    mixed = randn(batch, rows, 3 * width).bfloat16()
    conv_weight = randn(3 * width, 4)
    g = -torch.rand(batch, rows, heads, dim, generator=gen, device=device)
    beta = torch.rand(batch, rows, heads, generator=gen, device=device)
    ssm = StateSlots(
        torch.zeros(batch + 1, heads, dim, dim, device=device),
        metadata.state_slots,
        metadata.context_lens,
    )
    conv = StateSlots(
        torch.zeros(batch + 1, 3 * width, 3, dtype=mixed.dtype, device=device),
        metadata.state_slots,
        metadata.context_lens,
    )

    def split(conved):
        q, k, v = (
            part.reshape(batch, rows, heads, dim) for part in conved.split(width, -1)
        )
        return l2_normalize(q), l2_normalize(k), v

    def chunked():
        conved, final = causal_conv1d(mixed, conv_weight, conv.gather(), None)
        conv.scatter(final, None)
        q, k, v = split(conved)
        o, state = backend.prefill_backend.prefill(
            q, k, v, g, beta, ssm.gather(), metadata
        )
        ssm.scatter(state, None)
        return o

    def row_by_row():
        conved = backend.conv(mixed, conv_weight, conv, metadata)
        q, k, v = split(conved)
        return backend.decode(q, k, v, g, beta, ssm)

    return wall_us(chunked, iters), wall_us(row_by_row, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4x32,16x128")
    parser.add_argument("--rows", default="16,32,64,128,256")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; wall microseconds per layer call")
    print("heads x dim | batch | rows | chunked (fla) | decode kernels | ratio")
    for shape in args.shapes.split(","):
        heads, dim = (int(n) for n in shape.split("x"))
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            for rows in (int(r) for r in args.rows.split(",")):
                chunked, row_by_row = measure(heads, dim, batch, rows, args.iters)
                print(
                    f"{heads} x {dim} | {batch} | {rows} | {chunked:.0f} | "
                    f"{row_by_row:.0f} | {chunked / row_by_row:.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
