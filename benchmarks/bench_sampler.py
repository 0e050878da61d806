"""Time of the last stage's token choice alone: sampling, verification, Markov decode.

Random logits of a Kimi-size vocabulary; half the sequences sampled (temperature 0.8,
top-p 0.95), half greedy. Prints milliseconds per call for each batch size, a figure
to set against the model's step time (not a test). Usage:

    python benchmarks/bench_sampler.py --device cuda --vocab 163840 --drafts 3
    python benchmarks/bench_sampler.py --device cpu --vocab 1024 --batches 1,32
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from atom.model_ops.rejection_sampler import verify_drafts
from atom.model_ops.sampler import sample_tokens
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.spec_decode.markov_head import markov_decode


def milliseconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (allocator, kernels)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats * 1e3


@torch.inference_mode()
def bench(num_seqs: int, args: argparse.Namespace, device: torch.device) -> str:
    vocab, width = args.vocab, args.drafts
    sampling = SamplingMetadata.build(
        [0.8 if s % 2 else 0.0 for s in range(num_seqs)],
        top_ps=0.95,
        seeds=list(range(num_seqs)),
        positions=100,
        device=device,
    )
    logits = torch.randn(num_seqs, width + 1, vocab, device=device) * 3
    drafts = torch.randint(0, vocab, (num_seqs, width), device=device)
    counts = torch.full((num_seqs,), width, device=device)
    q = torch.softmax(torch.randn(num_seqs, width, vocab, device=device), -1)
    table = torch.randn(vocab, 8, device=device)

    def bias(prev: torch.Tensor) -> torch.Tensor:
        return table[prev] @ table.t()

    anchors = drafts[:, 0].clone()
    timings = {
        "sample": lambda: sample_tokens(logits[:, 0], sampling),
        "verify": lambda: verify_drafts(logits, drafts, counts, q, sampling),
        "markov": lambda: markov_decode(
            logits[:, :width], anchors, sampling.positions, bias, sampling
        ),
    }
    parts = [
        f"{name} {milliseconds(fn, device, args.repeats):.3f} ms"
        for name, fn in timings.items()
    ]
    return f"batch {num_seqs:4d}: " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--vocab", type=int, default=163840)
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{device}, vocab {args.vocab}, {args.drafts} drafts per sequence")
    for num_seqs in (int(b) for b in args.batches.split(",")):
        print(bench(num_seqs, args, device))


if __name__ == "__main__":
    main()
