"""Routed experts as grouped matrix products over tokens sorted by expert.

Every (token, choice) pair of the step is sorted by expert once; each expert then
multiplies one contiguous group of rows. Three paths compute the same products:

- `grouped_mm`: `torch._grouped_mm`, one kernel, no host sync. Used on the CPU and
  for bf16 prefill-sized steps on sm90+ GPUs; on CUDA its fp32 form copies between
  host and device, so a graph cannot capture it (seen with torch 2.11).
- `triton`: the grouped GEMM of `atom/kernels/expert_gemm.py`, one kernel per
  projection in any dtype, no host sync: every other CUDA case, decode-sized bf16
  steps included (`step_path`).
- `gemv`: each (token, choice) pair reads its expert directly, no sort
  (`atom/kernels/expert_gemv.py`), two launches with the activation between them:
  for a step of a token or two, asked for by name only until it reads faster than
  the grouped GEMM (`step_path`).
- `loop`: one `F.linear` per group, reading the group sizes on the host once (an
  old torch without `_grouped_mm`, misaligned widths, no Triton). Not capturable.

`routed_mlp` holds the sort and the combine with the two products as arguments, so
the fp8 experts (`quantization/ptpc_fp8.py`) share them with `grouped_expert_mlp`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from atom.kernels import triton_available
from atom.model_ops.activation import GatedAct, GatedActivation
from atom.model_ops.side_stream import Pending, joined

if TYPE_CHECKING:  # the kernel module imports triton, which may be absent
    from atom.kernels.expert_gemm import TileLists

ExpertPath = Literal["grouped_mm", "triton", "gemv", "loop"]
# The paths with no host synchronisation, which a CUDA graph can capture.
CAPTURABLE_PATHS = ("grouped_mm", "triton")

# The Triton alignment reads every id twice in each expert's program, so its work
# grows with pairs x experts: above this many (token, choice) pairs (prefill) the
# torch ops are faster.
_TRITON_ALIGN_MAX_PAIRS = 8192

# _grouped_mm wants 16-byte aligned rows.
_ALIGNMENT_BYTES = 16


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """Whether `torch._grouped_mm` runs for these operands without a host sync."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    element = torch.empty(0, dtype=dtype).element_size()
    if any(dim * element % _ALIGNMENT_BYTES for dim in dims):
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _grouped_linear(
    rows: torch.Tensor,
    weight: torch.Tensor,
    groups: ExpertGroups,
    path: ExpertPath,
    row_source: torch.Tensor | None = None,
    act: GatedAct | None = None,
) -> torch.Tensor:
    """out[r] = rows[row_source[r]] @ weight[e].T for sorted row r of group e, where
    group e is [end_{e-1}, end_e); row_source None means rows are already sorted.
    `act` (the `triton` path only) finishes the product with the gated activation."""
    group_ends = groups.ends
    if path == "triton":
        from atom.kernels.expert_gemm import expert_gemm

        return expert_gemm(
            rows,
            weight,
            group_ends,
            row_source,
            tile_lists=groups.tile_lists,
            act=act,
        )
    if act is not None:
        raise ValueError(f"the {path!r} path does not fuse the activation")
    if row_source is not None:
        rows = rows[row_source]
    if path == "grouped_mm":
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=group_ends)
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(group_ends.tolist()):
        if end > start:
            out[start:end] = F.linear(rows[start:end], weight[expert])
        start = end
    return out


# Decode-sized steps, up to this many (token, choice) pairs, take the Triton GEMM
# where `_grouped_mm` runs too: on an H100 (bf16, 64 experts of 2304 x 768, top 8,
# graph-captured) the expert MLP through it took 0.87-0.94x the time of
# `_grouped_mm`'s at 8 to 1024 pairs (`benchmarks/bench_kernels.py`, 2026-12-06).
# Larger steps (prefill) keep `_grouped_mm`, which was not measured against it.
_TRITON_DECODE_MAX_PAIRS = 1024


def step_path(path: ExpertPath, num_pairs: int, device: torch.device) -> ExpertPath:
    """The path one step takes: `path` (`expert_path`'s choice for the weights),
    except that a decode-sized CUDA step swaps `grouped_mm` for `triton`. No step
    takes `gemv`: its broadcast-and-sum form read dense weights of this size at
    0.63-0.92x cuBLAS's speed on an H100 (`benchmarks/bench_skinny_gemm.py`,
    2026-12-06), below the grouped GEMM's 70 % of the HBM rate;
    `benchmarks/bench_kernels.py` asks for it by name to measure the two."""
    if (
        path == "grouped_mm"
        and device.type == "cuda"
        and num_pairs <= _TRITON_DECODE_MAX_PAIRS
        and triton_available(device)
    ):
        return "triton"
    return path


def expert_path(w13: torch.Tensor, w2: torch.Tensor) -> ExpertPath:
    """The fastest path that runs these weights where they sit (module docstring)."""
    dims = (*w13.shape[1:], *w2.shape[1:])
    if grouped_mm_supported(w13.device, w13.dtype, *dims):
        return "grouped_mm"
    if w13.device.type == "cuda" and triton_available(w13.device):
        return "triton"
    return "loop"


def align_to_experts(
    expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_of, position, group_ends) of the (token, choice) pairs of
    expert_ids [T, k] sorted by expert.

    token_of [T*k]: the token of the pair at each sorted row, in a stable order, so
    pairs of one expert keep their token order; position [T*k]: the sorted row of
    each flat pair (token * k + choice); group_ends [E] int32: the cumulative group
    sizes. On CUDA a decode-sized step takes one Triton launch
    (`kernels/moe_align.py`).
    """
    flat_ids = expert_ids.reshape(-1)
    if (
        flat_ids.is_cuda
        and flat_ids.numel() <= _TRITON_ALIGN_MAX_PAIRS
        and triton_available(flat_ids.device)
    ):
        from atom.kernels.moe_align import align_to_experts_triton

        return align_to_experts_triton(expert_ids, num_experts)
    order = flat_ids.argsort(stable=True)
    # A scatter, not bincount: CUDA's bincount reads its input's max on the host.
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat_ids.device)
    counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    token_of = order // expert_ids.shape[-1]
    return token_of, position, counts.cumsum(0, dtype=torch.int32)


@dataclass
class ExpertGroups:
    """One step's rows sorted by expert: group e is rows [ends[e-1], ends[e]).

    `tile_lists` keeps the grouped GEMM's tile list per tile height
    (`kernels/expert_gemm.py` fills it), so the two products of an expert MLP, which
    share the groups, build it once. It lives for one forward, so a CUDA graph
    captures the launch that fills it.
    """

    ends: torch.Tensor
    tile_lists: TileLists = field(default_factory=dict)


@dataclass
class SortedPairs:
    """A step's (token, choice) pairs sorted by expert: the token of each sorted
    row, the sorted row of each pair (`align_to_experts`) and the groups."""

    token_of: torch.Tensor
    position: torch.Tensor
    groups: ExpertGroups


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> SortedPairs:
    """The pairs of expert_ids [T, k] sorted by expert (`align_to_experts`)."""
    token_of, position, group_ends = align_to_experts(expert_ids, num_experts)
    return SortedPairs(token_of, position, ExpertGroups(group_ends))


@dataclass
class ExpertChoice:
    """The router's choice for a step's tokens: mixing weights [T, k] fp32 and
    expert ids [T, k]. `sorted_pairs` holds the pairs already sorted by expert
    where the routing kernel sorted them too (`moe_router.choose_experts`)."""

    weights: torch.Tensor
    ids: torch.Tensor
    sorted_pairs: SortedPairs | None = None

    def sorted_by_expert(self, num_experts: int) -> SortedPairs:
        """The pairs sorted by expert: the router's sort where it made one, else a
        sort now."""
        if self.sorted_pairs is not None:
            return self.sorted_pairs
        return sort_by_expert(self.ids, num_experts)


# One projection of every routed row: (rows, groups, row_source) -> the sorted
# rows' outputs, as `_grouped_linear` defines them.
GroupedProduct = Callable[
    [torch.Tensor, ExpertGroups, torch.Tensor | None], torch.Tensor
]


def gated_up_product(
    product: Callable[[GatedAct | None], GroupedProduct],
    act: Callable[[torch.Tensor], torch.Tensor],
    path: ExpertPath,
) -> GroupedProduct:
    """The activated gate/up rows: `product(fused)` of the gate/up weight, where the
    grouped GEMM finishes it with `act` itself (the `triton` path and an activation
    it knows), else `act` after `product(None)`."""
    if path == "triton" and isinstance(act, GatedActivation):
        return product(act.kernel_args())
    up = product(None)
    return lambda rows, groups, row_source: act(up(rows, groups, row_source))


def routed_mlp(
    x: torch.Tensor,
    choice: ExpertChoice,
    num_experts: int,
    gated_up: GroupedProduct,
    down: GroupedProduct,
    addend: torch.Tensor | Pending | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """sum_k weights[:, k] * down(gated_up(x)) for the chosen experts ids[:, k] (+
    addend), [N, D] in `out_dtype`: the sort by expert and the combine around two
    grouped products (`gated_up` reads x through the sorted rows' tokens and gives
    the activated rows), whatever form the weights take."""
    pairs = choice.sorted_by_expert(num_experts)
    y = down(gated_up(x, pairs.groups, pairs.token_of), pairs.groups, None)
    # A pending addend (the shared experts on a side stream) joins only here, so
    # its products run under the whole routed chain.
    return combine_expert_rows(
        y, pairs.position, choice.weights, joined(addend), out_dtype
    )


def grouped_expert_mlp(
    x: torch.Tensor,
    choice: ExpertChoice,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    path: ExpertPath,
    row_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    addend: torch.Tensor | Pending | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """sum_k weights[:, k] * expert_{ids[:, k]}(x) (+ addend) as [N, D] in
    `out_dtype`, summed in fp32, for the router's `choice`.

    x [N, D]; choice's weights and ids [N, k]; w13 [E, 2I, D] (gate rows first);
    w2 [E, D, I]; `act` maps [M, 2I] to [M, I]; `path` as `expert_path` chooses for
    these weights (or any path that runs on their device). `row_transform`, when
    given, maps the rows each projection reads (fp8 rounds them per token).
    `addend` [N, D] (the shared experts' output, possibly still pending on a side
    stream) joins the sum before its rounding.
    """
    if path == "gemv":  # plain weights only: no row transform
        from atom.kernels.expert_gemv import expert_down_sum, expert_up

        ids = choice.ids.contiguous()
        h = act(expert_up(x.contiguous(), ids, w13))
        out = expert_down_sum(h, ids, choice.weights.contiguous(), w2)
        return _finish_sum(out, joined(addend), out_dtype)
    transform = row_transform or (lambda rows: rows)

    def product(weight: torch.Tensor, fused: GatedAct | None = None) -> GroupedProduct:
        return lambda rows, groups, row_source: _grouped_linear(
            transform(rows), weight, groups, path, row_source, fused
        )

    return routed_mlp(
        x,
        choice,
        w13.shape[0],
        gated_up_product(lambda fused: product(w13, fused), act, path),
        product(w2),
        addend,
        out_dtype,
    )


def combine_expert_rows(
    y: torch.Tensor,
    position: torch.Tensor,
    routing_weights: torch.Tensor,
    addend: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[T, D] in `out_dtype`: each token's k rows of the sorted expert output y
    [T*k, D], read at `position` and summed in fp32 with their routing weights [T,
    k], then `addend` [T, D] added before the one rounding. A gather and a
    reduction, where a scatter-add into the tokens would take atomics; on CUDA one
    Triton launch (`kernels/moe_combine.py`)."""
    if y.is_cuda and triton_available(y.device):
        from atom.kernels.moe_combine import combine_expert_rows_triton

        return combine_expert_rows_triton(
            y, position, routing_weights, addend, out_dtype
        )
    num_tokens, top_k = routing_weights.shape
    per_choice = y.index_select(0, position).view(num_tokens, top_k, -1).float()
    out = (per_choice * routing_weights.float().unsqueeze(-1)).sum(dim=1)
    return _finish_sum(out, addend, out_dtype)


def _finish_sum(
    out: torch.Tensor, addend: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """An fp32 expert sum plus `addend`, rounded once to `out_dtype`: the torch
    form of the combine kernel's epilogue."""
    if addend is not None:
        out = out + addend.float()
    return out.to(out_dtype)
