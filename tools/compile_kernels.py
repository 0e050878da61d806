"""Compile atom's Triton kernels for a GPU target on a machine without one.

The kernel tests run on the CPU through Triton's interpreter, which checks what a
kernel computes but not that the compiler takes it: a construct the interpreter
runs may still fail to compile for a GPU. Triton's wheel carries the NVIDIA
assembler, so the kernels listed here (those added since the last GPU run took the
others) compile down to sm_90 machine code on any machine, with the Triton version
the GPU machine has installed in a side environment if need be:

    python -m tools.compile_kernels                  # every kernel, sm_90
    python -m tools.compile_kernels --arch 80 --only gated_act

Each line names a kernel, its compile-time settings and OK or the compiler's error;
the exit status is 1 if any failed. The argument types below are those the launch
wrappers in `atom/kernels/` pass for bf16 and fp32 models.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from dataclasses import dataclass

# Compiling needs the real Triton, not the interpreter the tests set (it is read
# when the kernels are defined, so this runs as its own process).
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@dataclass(frozen=True)
class KernelSpec:
    """One kernel compiled with given argument types and compile-time values."""

    module: str  # under atom.kernels
    kernel: str
    types: dict[str, str]  # runtime argument -> Triton type ("*bf16", "i32", ...)
    constants: dict[str, object]

    def source(self) -> ASTSource:
        fn = getattr(
            importlib.import_module(f"atom.kernels.{self.module}"), self.kernel
        )
        names = inspect.signature(fn.fn).parameters
        signature = {
            name: "constexpr" if name in self.constants else self.types[name]
            for name in names
        }
        return ASTSource(fn=fn, signature=signature, constexprs=self.constants)


def _specs() -> list[KernelSpec]:
    routing = dict(SOFTMAX=False, HAS_BIAS=True, RENORMALIZE=True, BLOCK_E=512)
    specs = [
        KernelSpec(
            "moe_routing",
            "_select_experts_kernel",
            dict(
                logits_ptr="*fp32",
                bias_ptr="*fp32",
                weights_ptr="*fp32",
                ids_ptr="*i64",
                num_experts="i32",
                stride_logits="i32",
                routed_scaling_factor="fp32",
            ),
            {**routing, **grouping},
        )
        for grouping in (
            dict(TOP_K=8, GROUPS=1, PER_GROUP=32, TOPK_GROUP=1, BLOCK_K=8, BLOCK_G=1),
            dict(TOP_K=6, GROUPS=8, PER_GROUP=48, TOPK_GROUP=4, BLOCK_K=8, BLOCK_G=8),
        )
    ]
    specs.append(
        KernelSpec(
            "moe_route_sort",
            "_route_sort_kernel",
            dict(
                logits_ptr="*fp32",
                bias_ptr="*fp32",
                weights_ptr="*fp32",
                ids_ptr="*i64",
                token_of_ptr="*i32",
                position_ptr="*i32",
                group_ends_ptr="*i32",
                tile_expert_ptr="*i32",
                tile_row_ptr="*i32",
                num_tokens="i32",
                num_experts="i32",
                stride_logits="i32",
                routed_scaling_factor="fp32",
                num_tiles="i32",
            ),
            dict(
                routing,
                TOP_K=8,
                GROUPS=1,
                PER_GROUP=32,
                TOPK_GROUP=1,
                BLOCK_K=8,
                BLOCK_G=1,
                BLOCK_M=16,
                BLOCK_T=128,
            ),
        )
    )
    specs.append(
        KernelSpec(
            "moe_align",
            "_align_kernel",
            dict(
                ids_ptr="*i64",
                token_of_ptr="*i32",
                position_ptr="*i32",
                group_ends_ptr="*i32",
                num_pairs="i32",
                pairs_per_token="i32",
            ),
            dict(BLOCK_N=32),
        )
    )
    specs.append(
        KernelSpec(
            "expert_gemm",
            "_tiles_kernel",
            dict(
                group_end_ptr="*i32",
                tile_expert_ptr="*i32",
                tile_row_ptr="*i32",
                num_experts="i32",
                num_tiles="i32",
            ),
            dict(BLOCK_M=16, BLOCK_T=32, BLOCK_E=512),
        )
    )
    # A DSpark step's greedy verify (T = 7 drafts: 8 verify rows).
    pointers = "best row_index drafts num_drafts positions out anchor_positions"
    specs.append(
        KernelSpec(
            "greedy_verify",
            "_greedy_verify_kernel",
            {
                **{f"{name}_ptr": "*i64" for name in pointers.split()},
                **dict.fromkeys(("num_seqs", "T", "out_stride"), "i32"),
            },
            dict(BLOCK_S=16, BLOCK_W=8),
        )
    )
    # Async scheduling's pending rows: in steady order with one count, and
    # selected with counts of their own.
    ints = (
        "rows unconfirmed_all next_stride accepted_stride positions_at context_at "
        "slots_at tables_at table_width query_at query_width block_size"
    )
    pointers = "packed next_inputs accepted works firsts sources unconfirmed rejected"
    for in_order in (True, False):
        specs.append(
            KernelSpec(
                "pending_fill",
                "_pending_fill_kernel",
                {
                    **{f"{name}_ptr": "*i64" for name in pointers.split()},
                    **dict.fromkeys(ints.split(), "i32"),
                },
                dict(
                    IN_ORDER=in_order,
                    ONE_COUNT=in_order,
                    BLOCK_R=8,
                    BLOCK_Q=8,
                ),
            )
        )
    # DSpark's greedy Markov chain (K3.1's rank 256; the tiny drafts' 16).
    for w, block_v, block_r in (("*bf16", 32, 256), ("*fp32", 512, 16)):
        specs.append(
            KernelSpec(
                "markov_drafts",
                "_markov_scores_kernel",
                dict(
                    base_ptr="*fp32",
                    prev_ptr="*i64",
                    w1_ptr=w,
                    w2_ptr=w,
                    best_ptr="*fp32",
                    where_ptr="*i32",
                    **dict.fromkeys(
                        "num_seqs vocab rank num_blocks stride_base stride_prev "
                        "stride_w1 stride_w2".split(),
                        "i32",
                    ),
                ),
                dict(BLOCK_V=block_v, BLOCK_R=block_r),
            )
        )
    specs.append(
        KernelSpec(
            "markov_drafts",
            "_markov_pick_kernel",
            dict(
                best_ptr="*fp32",
                where_ptr="*i32",
                out_ptr="*i64",
                num_blocks="i32",
                vocab="i32",
                stride_out="i32",
            ),
            dict(BLOCK_B=1024),
        )
    )
    for dt in ("fp32", "bf16"):
        specs += _per_dtype_specs(dt)
    return specs


def _per_dtype_specs(dt: str) -> list[KernelSpec]:
    """The kernels whose operands take the model's dtype."""
    specs = [
        # The partial sum in fp32, and one rank's block output with the shared
        # experts' output added, in the model dtype.
        *(
            KernelSpec(
                "moe_combine",
                "_combine_kernel",
                dict(
                    y_ptr=f"*{dt}",
                    position_ptr="*i32",
                    weights_ptr="*fp32",
                    addend_ptr=f"*{dt}",
                    out_ptr=out,
                    width="i32",
                    stride_y="i32",
                    stride_addend="i32",
                ),
                dict(TOP_K=8, HAS_ADDEND=addend, BLOCK=1024),
            )
            for out, addend in (("*fp32", False), (f"*{dt}", True))
        ),
        KernelSpec(
            "kda_head_norms",
            "_l2_normalize_qk_kernel",
            dict(
                x_ptr=f"*{dt}",
                q_ptr="*fp32",
                k_ptr="*fp32",
                heads="i32",
                stride_x="i32",
                eps="fp32",
            ),
            dict(DIM=128, BLOCK=128),
        ),
        KernelSpec(
            "kda_head_norms",
            "_output_norm_gate_kernel",
            dict(
                o_ptr="*fp32",
                w_ptr="*fp32",
                gate_ptr=f"*{dt}",
                out_ptr=f"*{dt}",
                heads="i32",
                stride_o="i32",
                stride_gate="i32",
                eps="fp32",
            ),
            dict(DIM=128, BLOCK=128),
        ),
        KernelSpec(
            "fp8_quant",
            "_quantize_rows_kernel",
            dict(
                x_ptr=f"*{dt}",
                codes_ptr="*u8",
                scale_ptr="*fp32",
                K="i32",
                stride_x="i32",
                stride_codes="i32",
                min_scale="fp32",
            ),
            dict(FP8_MAX=448.0, BLOCK=1024),
        ),
    ]
    gated = dict(
        x_ptr=f"*{dt}", out_ptr=f"*{dt}", inner="i32", stride_x="i32", p0="fp32"
    )
    for act in range(3):
        specs.append(
            KernelSpec(
                "gated_act",
                "_gated_act_kernel",
                {**gated, "p1": "fp32"},
                dict(ACT=act, HAS_P1=act != 0, BLOCK=1024),
            )
        )
    gates = dict(
        f_ptr=f"*{dt}",
        a_log_ptr="*fp32",
        dt_bias_ptr="*fp32",
        b_ptr="*fp32",
        decay_ptr="*fp32",
        beta_ptr="*fp32",
        heads="i32",
        stride_f="i32",
        stride_b="i32",
        lower_bound="fp32",
    )
    for bounded in (False, True):
        specs.append(
            KernelSpec(
                "kda_gates",
                "_kda_gates_kernel",
                gates,
                dict(BOUNDED=bounded, DIM=128, BLOCK=128),
            )
        )
    # The KDA decode / verify kernel: rows prepared apart, or raw (q and k normalised
    # and the gates formed inside it), the latter with either gate form.
    for raw, bounded in ((False, False), (True, False), (True, True)):
        specs.append(_kda_decode_spec(dt, raw, bounded))
    # The grouped expert GEMM: plain in the model dtype, and fp8 (native e4m3
    # operands, or the bits decoded in-kernel).
    forms = [(f"*{dt}", f"*{dt}", False, False)]
    if dt == "bf16":
        forms += [("*fp8e4nv", "*bf16", True, False), ("*u8", "*bf16", True, True)]
    for operand, out, fp8, decode in forms:
        for gather in (False, True):
            specs.append(_expert_gemm_spec(operand, out, fp8, decode, gather, dt))
        # The gate/up product finished with SiLU, and with SiTU's two betas.
        for act, has_p1 in ((0, False), (1, True)):
            specs.append(
                _expert_gemm_spec(operand, out, fp8, decode, True, dt, act, has_p1)
            )
    # Paged GQA decode and the indexer's block scores (MiniMax-M3's shapes: 16
    # query heads a KV head, head and index dims of 128), over a cache in the
    # model dtype or in fp8.
    for cache in (f"*{dt}", "*fp8e4nv"):
        for sparse in (False, True):
            specs.append(_gqa_decode_spec(dt, cache, sparse))
        specs.append(_index_scores_spec(dt, cache))
        # Paged MLA decode (Kimi's latent rank 512 + RoPE 64), whose context splits
        # now share each row's visible keys.
        specs.append(_mla_decode_spec(dt, cache))
    return specs


def _kda_decode_spec(dt: str, raw: bool, bounded: bool) -> KernelSpec:
    ints = (
        "rows heads q_sb q_st q_sh k_sb k_st k_sh v_sb v_st v_sh g_sb g_st g_sh "
        "beta_sb beta_st beta_sh stride_pool stride_snap_slot stride_snap_row"
    )
    return KernelSpec(
        "kda_decode",
        "_kda_decode_kernel",
        dict(
            q_ptr=f"*{dt}",
            k_ptr=f"*{dt}",
            v_ptr=f"*{dt}",
            g_ptr=f"*{dt}" if raw else "*fp32",
            beta_ptr="*fp32",
            a_log_ptr="*fp32",
            dt_bias_ptr="*fp32",
            starts_ptr="*i64",
            o_ptr="*fp32",
            pool_ptr="*fp32",
            snap_ptr="*fp32",
            slot_ptr="*i64",
            context_lens_ptr="*i64",
            scale="fp32",
            lower_bound="fp32",
            eps="fp32",
            **dict.fromkeys(ints.split(), "i32"),
        ),
        dict(
            KEY_DIM=128,
            VALUE_DIM=128,
            BLOCK_V=16,
            SNAPSHOTS=raw,
            RAW=raw,
            BOUNDED=bounded,
        ),
    )


def _mla_decode_spec(dt: str, cache: str) -> KernelSpec:
    ieee = dt == "fp32"
    ints = (
        "heads rows_per_seq table_width block_size min_split_keys stride_q_row "
        "stride_q_head stride_pe_row stride_pe_head stride_cache_row"
    )
    return KernelSpec(
        "paged_mla_decode",
        "_mla_decode_kernel",
        dict(
            q_ptr=f"*{dt}",
            q_pe_ptr=f"*{dt}",
            cache_ptr=cache,
            table_ptr="*i64",
            position_ptr="*i64",
            acc_ptr="*fp32",
            stats_ptr="*fp32",
            scale="fp32",
            kv_scale="fp32",
            **dict.fromkeys(ints.split(), "i32"),
        ),
        dict(
            RANK=512,
            ROPE=64,
            BLOCK_C=512,
            BLOCK_R=64,
            BLOCK_H=16,
            BLOCK_N=16 if ieee else 32,
            IEEE=ieee,
            FP8_CACHE=cache == "*fp8e4nv",
        ),
    )


def _gqa_decode_spec(dt: str, cache: str, sparse: bool) -> KernelSpec:
    ieee = dt == "fp32"
    ints = (
        "heads group rows_per_seq table_width block_size sparse_block_size "
        "min_split_keys k_offset v_offset stride_q_row stride_q_head "
        "stride_cache_row stride_keep_seq stride_keep_group stride_keep_row"
    )
    return KernelSpec(
        "paged_gqa_decode",
        "_gqa_decode_kernel",
        dict(
            q_ptr=f"*{dt}",
            cache_ptr=cache,
            table_ptr="*i64",
            position_ptr="*i64",
            key_end_ptr="*i64",
            keep_ptr="*u8" if sparse else "*fp32",
            acc_ptr="*fp32",
            stats_ptr="*fp32",
            scale="fp32",
            kv_scale="fp32",
            **dict.fromkeys(ints.split(), "i32"),
        ),
        dict(
            HEAD_DIM=128,
            BLOCK_D=128,
            BLOCK_G=16,
            BLOCK_N=16 if ieee else 64,
            IEEE=ieee,
            FP8_CACHE=cache == "*fp8e4nv",
            SPARSE=sparse,
        ),
    )


def _index_scores_spec(dt: str, cache: str) -> KernelSpec:
    ints = (
        "groups rows_per_seq table_width block_size sparse_block_size index_offset "
        "stride_q_row stride_q_head stride_cache_row"
    )
    return KernelSpec(
        "paged_index_scores",
        "_index_scores_kernel",
        dict(
            q_ptr=f"*{dt}",
            cache_ptr=cache,
            table_ptr="*i64",
            position_ptr="*i64",
            key_end_ptr="*i64",
            out_ptr="*fp32",
            kv_scale="fp32",
            **dict.fromkeys(ints.split(), "i32"),
        ),
        dict(
            DIM=128,
            BLOCK_D=128,
            BLOCK_G=16,
            BLOCK_N=64,
            IEEE=dt == "fp32",
            FP8_CACHE=cache == "*fp8e4nv",
        ),
    )


def _expert_gemm_spec(
    operand: str,
    out: str,
    fp8: bool,
    decode: bool,
    gather: bool,
    dt: str,
    act: int = -1,
    has_p1: bool = False,
) -> KernelSpec:
    ieee = dt == "fp32" and not fp8
    return KernelSpec(
        "expert_gemm",
        "_expert_gemm_kernel",
        dict(
            a_ptr=operand,
            row_source_ptr="*i32",
            w_ptr=operand,
            out_ptr=out,
            a_scale_ptr="*fp32",
            w_scale_ptr="*fp32",
            tile_expert_ptr="*i32",
            tile_row_ptr="*i32",
            group_end_ptr="*i32",
            num_experts="i32",
            N="i32",
            K="i32",
            stride_a="i32",
            stride_we="i32",
            stride_wn="i32",
            stride_out="i32",
            p0="fp32",
            p1="fp32",
        ),
        dict(
            GATHER=gather,
            IEEE=ieee,
            FP8=fp8,
            DECODE=decode,
            ACT=act,
            HAS_P1=has_p1,
            BLOCK_M=16,
            BLOCK_N=64 if act < 0 else 32,
            BLOCK_K=128 if fp8 else 32 if ieee else 64,
        ),
    )


def compile_spec(spec: KernelSpec, arch: int) -> str | None:
    """None when `spec` compiles for sm_`arch`, else the compiler's error."""
    try:
        triton.compile(spec.source(), target=GPUTarget("cuda", arch, 32))
    except Exception as error:  # noqa: BLE001 - the report names any failure
        return f"{type(error).__name__}: {error}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="sm_ARCH (default 90)")
    parser.add_argument("--only", help="kernel modules, comma separated")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    failed = 0
    print(f"triton {triton.__version__}, sm_{args.arch}")
    for spec in _specs():
        if only and spec.module not in only:
            continue
        error = compile_spec(spec, args.arch)
        failed += error is not None
        print(f"{'OK  ' if error is None else 'FAIL'} {spec.kernel} {spec.constants}")
        if error:
            print(f"     {error[:2000]}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
