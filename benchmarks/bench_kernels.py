"""atom's Triton kernels against their torch references at the benchmark's shapes.

Shapes are those of `bench_vs_transformers.py`'s issue10 preset (2.6 B Kimi Linear,
bf16): KDA 16 heads of 128, conv width 4, MLA 16 heads over a 512 + 64 latent row
at 320 tokens of context in a 400-token table, RMSNorm over 2304; MiniMax-M3's GQA
(64 query heads over 4 KV heads of 128, dense and with the lightning indexer) over
the same table; the bf16 routed experts (64 of width 2304 and 768 inner, top 8)
through atom's Triton grouped GEMM against `torch._grouped_mm`; ptpc_fp8's linear
at 4096 x 7168 and those experts against the same products in bf16. Per kernel and
batch it prints microseconds per call (CUDA events, mean of `--iters` replays
after a warm-up), the bytes the call must move at least, the bandwidth that gives as a
fraction of the GPU's datasheet HBM bandwidth (`hbm_peak.py`), and the speed-up over the torch reference. Each
call is timed as a CUDA graph replay, as the engine runs decode.

    python benchmarks/bench_kernels.py --batch-sizes 1,32,128
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from hbm_peak import resolve_hbm_bytes_per_s

from atom.kernels.rms_norm import rms_norm_triton
from atom.model_engine.batch import SeqWork
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_ops.activation import get_act_and_mul
from atom.model_ops.attention_backend import (
    GQALayer,
    LatentLayer,
    TorchGQABackend,
    TorchMLABackend,
    select_gqa_backend,
    select_mla_backend,
)
from atom.model_ops.block_sparse import IndexerConfig
from atom.model_ops.grouped_experts import (
    ExpertChoice,
    expert_path,
    grouped_expert_mlp,
    grouped_mm_supported,
)
from atom.model_ops.kda import l2_normalize
from atom.model_ops.kda_backend import (
    StateSlots,
    select_kda_backend,
    torch_conv,
    torch_decode,
)
from atom.model_ops.layernorm import rms_norm_reference
from atom.model_ops.quantization.ptpc_fp8 import (
    fp8_expert_mlp,
    fp8_linear,
    quantize_rows,
)

KDA_HEADS, KDA_DIM, CONV_WIDTH = 16, 128, 4
MLA_HEADS, NOPE, ROPE, RANK, V_DIM = 16, 128, 64, 512, 128
HIDDEN, CONTEXT, TABLE_TOKENS, BLOCK_SIZE = 2304, 320, 400, 16
LINEAR_OUT, LINEAR_IN = 4096, 7168
EXPERTS, TOP_K, EXPERT_INNER = 64, 8, 768
GQA_HEADS, GQA_KV_HEADS, GQA_DIM = 64, 4, 128
INDEXER = IndexerConfig(
    num_heads=GQA_KV_HEADS,
    head_dim=128,
    block_size=128,
    topk_blocks=16,
    local_blocks=1,
    init_blocks=0,
)


def time_us(fn: Callable[[], object], iters: int) -> float:
    """GPU microseconds per call: `fn` captured in a CUDA graph and replayed, so the
    host's launch cost (tens of microseconds per op in eager mode) is left out."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


@functools.cache
def peak_rate() -> float:
    return resolve_hbm_bytes_per_s(None)


def report(name: str, batch: int, ours: float, reference: float, nbytes: float):
    rate = nbytes / (ours * 1e-6)
    print(
        f"{name:12s} batch {batch:4d}: triton {ours:8.1f} us, torch {reference:8.1f} "
        f"us ({reference / ours:5.2f}x); {nbytes / 1e6:7.2f} MB -> "
        f"{rate / 1e9:6.0f} GB/s = {100 * rate / peak_rate():5.1f} % of HBM"
    )


def decode_metadata(batch: int, context: int, rows: int = 1):
    blocks = TABLE_TOKENS // BLOCK_SIZE
    works = [
        SeqWork(
            seq_id=b,
            token_ids=[1] * rows,
            context_len=context,
            block_table=list(range(b * blocks, (b + 1) * blocks)),
            state_slot=b,
            num_drafts=rows - 1,
        )
        for b in range(batch)
    ]
    return prepare_inputs(works, BLOCK_SIZE, "cuda", table_width=blocks)[2]


def bench_kda(batch: int, iters: int) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    metadata = decode_metadata(batch, CONTEXT)
    width = KDA_HEADS * KDA_DIM
    mixed = torch.randn(batch, 1, 3 * width, device=dev, dtype=bf16)
    q, k, v = (p.reshape(batch, 1, KDA_HEADS, KDA_DIM) for p in mixed.split(width, -1))
    q, k = l2_normalize(q), l2_normalize(k)
    g = -torch.rand(batch, 1, KDA_HEADS, KDA_DIM, device=dev)
    beta = torch.rand(batch, 1, KDA_HEADS, device=dev)
    pool = torch.randn(batch, KDA_HEADS, KDA_DIM, KDA_DIM, device=dev) * 0.1
    states = StateSlots(pool, metadata.state_slots, metadata.context_lens)
    triton = select_kda_backend(dev, "triton")
    ours = time_us(lambda: triton.decode(q, k, v, g, beta, states), iters)
    reference = time_us(lambda: torch_decode(q, k, v, g, beta, states), iters)
    report("kda decode", batch, ours, reference, 2 * pool.numel() * 4)
    conv_pool = torch.randn(batch, 3 * width, CONV_WIDTH - 1, device=dev, dtype=bf16)
    weight = torch.randn(3 * width, CONV_WIDTH, device=dev)
    conv = StateSlots(conv_pool, metadata.state_slots, metadata.context_lens)
    ours = time_us(lambda: triton.conv(mixed, weight, conv, metadata), iters)
    reference = time_us(lambda: torch_conv(mixed, weight, conv, metadata), iters)
    moved = 2 * conv_pool.numel() * 2 + 2 * mixed.numel() * 2
    report("kda conv", batch, ours, reference, moved)


def bench_mla(batch: int, iters: int) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    metadata = decode_metadata(batch, CONTEXT)
    blocks = batch * TABLE_TOKENS // BLOCK_SIZE
    cache = torch.randn(blocks, BLOCK_SIZE, RANK + ROPE, device=dev, dtype=bf16)
    q_nope = torch.randn(batch, MLA_HEADS, NOPE, device=dev, dtype=bf16)
    q_pe = torch.randn(batch, MLA_HEADS, ROPE, device=dev, dtype=bf16)
    latent = torch.randn(batch, RANK + ROPE, device=dev, dtype=bf16)
    kv_b = torch.randn(MLA_HEADS * (NOPE + V_DIM), RANK, device=dev, dtype=bf16) / 20
    layer = LatentLayer(cache, 1.0, kv_b, V_DIM, 0.07)
    args = (q_nope, q_pe, latent, layer, metadata)
    triton = select_mla_backend(dev, "triton")
    ours = time_us(lambda: triton.forward(*args), iters)
    reference = time_us(lambda: TorchMLABackend().forward(*args), iters)
    moved = batch * (CONTEXT + 1) * (RANK + ROPE) * 2 + kv_b.numel() * 2
    report("mla decode", batch, ours, reference, moved)


def bench_gqa(batch: int, iters: int) -> None:
    for indexer in (None, INDEXER):
        bench_gqa_layer(batch, iters, indexer)


def bench_gqa_layer(batch: int, iters: int, indexer: IndexerConfig | None) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    metadata = decode_metadata(batch, CONTEXT)
    blocks = batch * TABLE_TOKENS // BLOCK_SIZE
    index_dim = indexer.head_dim if indexer is not None else 0
    row = 2 * GQA_KV_HEADS * GQA_DIM + index_dim
    cache = torch.randn(blocks, BLOCK_SIZE, row, device=dev, dtype=bf16)
    q = torch.randn(batch, GQA_HEADS, GQA_DIM, device=dev, dtype=bf16)
    rows = torch.randn(batch, row, device=dev, dtype=bf16)
    index_q = None
    if indexer is not None:
        index_q = torch.randn(batch, GQA_KV_HEADS, index_dim, device=dev, dtype=bf16)
    layer = GQALayer(cache, 1.0, GQA_KV_HEADS, GQA_DIM, GQA_DIM**-0.5, indexer)
    args = (q, rows, index_q, layer, metadata)
    triton = select_gqa_backend(dev, "triton")
    ours = time_us(lambda: triton.forward(*args), iters)
    reference = time_us(lambda: TorchGQABackend().forward(*args), iters)
    moved = batch * (CONTEXT + 1) * row * 2
    report("gqa sparse" if indexer else "gqa decode", batch, ours, reference, moved)


def expert_operands(batch: int) -> tuple:
    """(x, routing weights, expert ids, w13, w2, act) of the benchmark's routed
    experts in bf16: each token picks TOP_K distinct experts at random."""
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(batch, HIDDEN, device=dev, dtype=bf16)
    ids = torch.stack([torch.randperm(EXPERTS, device=dev)[:TOP_K] for _ in x])
    routing = torch.rand(batch, TOP_K, device=dev)
    w13 = torch.randn(EXPERTS, 2 * EXPERT_INNER, HIDDEN, device=dev, dtype=bf16) / 50
    w2 = torch.randn(EXPERTS, HIDDEN, EXPERT_INNER, device=dev, dtype=bf16) / 30
    act = get_act_and_mul("silu")
    return x, ExpertChoice(routing, ids), w13, w2, act


def bench_experts(batch: int, iters: int) -> None:
    """The bf16 routed experts: atom's Triton grouped GEMM ("triton" path) against
    `torch._grouped_mm` (the path bf16 takes on sm90), both graph-captured; at a
    few tokens also the per-pair GEMV ("gemv") against that grouped GEMM."""
    x, choice, w13, w2, act = expert_operands(batch)
    dims = (*w13.shape[1:], *w2.shape[1:])
    if not grouped_mm_supported(w13.device, w13.dtype, *dims):
        return

    def run(path: str) -> float:
        return time_us(lambda: grouped_expert_mlp(x, choice, w13, w2, act, path), iters)

    used = min(EXPERTS, batch * TOP_K)
    moved = used * 3 * w2[0].numel() * 2
    grouped = run("triton")
    report("bf16 experts", batch, grouped, run("grouped_mm"), moved)
    if batch * TOP_K <= 32:  # the unsorted per-pair GEMV against the grouped GEMM
        report("expert gemv", batch, run("gemv"), grouped, moved)


def bench_norm(batch: int, iters: int) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(batch, HIDDEN, device=dev, dtype=bf16)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, device=dev, dtype=bf16)
    ours = time_us(lambda: rms_norm_triton(x, weight, 1e-6, residual=residual), iters)

    def reference():
        summed = x + residual
        return rms_norm_reference(summed, weight, 1e-6), summed

    report("add+rmsnorm", batch, ours, time_us(reference, iters), 4 * x.numel() * 2)


def bench_fp8(batch: int, iters: int) -> None:
    """ptpc_fp8 against bf16: the fp8 linear, then the routed experts (whose fp8
    reference syncs with the host, so it has no graph to time)."""
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(batch, LINEAR_IN, device=dev, dtype=bf16)
    weight = torch.randn(LINEAR_OUT, LINEAR_IN, device=dev, dtype=bf16) / 80
    codes, scale = quantize_rows(weight)
    ours = time_us(lambda: fp8_linear(x, codes, scale), iters)
    moved = codes.numel() + (x.numel() + batch * LINEAR_OUT) * 2
    report(
        "fp8 linear", batch, ours, time_us(lambda: F.linear(x, weight), iters), moved
    )
    x, choice, w13, w2, act = expert_operands(batch)
    path = expert_path(w13, w2)

    def reference():
        return grouped_expert_mlp(x, choice, w13, w2, act, path)

    experts = torch.nn.Module()
    experts.act = act
    for name, stack in (("w13", w13), ("w2", w2)):
        codes, scale = quantize_rows(stack)
        setattr(experts, name, codes)
        setattr(experts, f"{name}_scale", scale)
    ours = time_us(lambda: fp8_expert_mlp(x, choice, experts), iters)
    used = min(EXPERTS, batch * TOP_K)
    report(
        "fp8 experts", batch, ours, time_us(reference, iters), used * 3 * w2[0].numel()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        with torch.inference_mode():
            bench_kda(batch, args.iters)
            bench_mla(batch, args.iters)
            bench_gqa(batch, args.iters)
            bench_norm(batch, args.iters)
            bench_experts(batch, args.iters)
            bench_fp8(batch, args.iters)


if __name__ == "__main__":
    main()
