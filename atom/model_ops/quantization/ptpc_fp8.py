"""ptpc_fp8: fp8 e4m3 weights with one scale per output channel, activations
quantized per token at run time.

Weights load in the model dtype and are quantized once after loading, on each rank's
own shard (a row-parallel shard's channel scales cover only its slice of the input).
The forward quantizes each token row of the input with its own scale and multiplies:

- on NVIDIA CUDA sm89+ with a bf16 model, `torch._scaled_mm` with row-wise scales
  (scale_a [M, 1], scale_b [1, N], fp32) when both widths are multiples of 16;
- elsewhere a reference path: the same per-token quantization, dequantized, and an
  fp32 product, so the CPU's numbers match the GPU's up to accumulation order.

The per-token quantization of the `_scaled_mm` path is the Triton kernel of
`atom/kernels/fp8_quant.py` (one launch, the same codes as `quantize_rows`).

Routed experts quantize their stacked weights per output channel the same way. On
CUDA with Triton their forward quantizes the tokens (that kernel) and runs both
projections as fp8 grouped GEMMs (`atom/kernels/expert_gemm.py`), with no host sync,
so CUDA graphs capture them. Elsewhere the reference dequantizes the experts a step
uses (reading which they are syncs with the host) and simulates the activation
rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.kernels import triton_available
from atom.model_ops.activation import GatedAct
from atom.model_ops.grouped_experts import (
    ExpertChoice,
    ExpertGroups,
    GroupedProduct,
    expert_path,
    gated_up_product,
    grouped_expert_mlp,
    routed_mlp,
)
from atom.model_ops.side_stream import Pending

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Keeps an all-zero row finite: its codes are 0 whatever the scale.
MIN_SCALE = 1e-12
# torch._scaled_mm needs both GEMM widths to be multiples of 16.
SCALED_MM_ALIGNMENT = 16


def quantize_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 scales [..., 1]) with one scale per row of the last dim:
    amax / 448, so each row's largest magnitude maps to e4m3's largest value."""
    values = tensor.float()
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    codes = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_rows(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (codes.float() * scale).to(dtype)


def round_trip_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as per-row fp8 quantization leaves it, in fp32: what the fp8 GEMM
    reads for an activation."""
    return dequantize_rows(*quantize_rows(tensor))


def quantize_activations(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of rows [M, K], in one Triton launch where one runs."""
    if not triton_available(rows.device):
        return quantize_rows(rows)
    from atom.kernels.fp8_quant import quantize_rows_triton

    return quantize_rows_triton(rows, MIN_SCALE)


def scaled_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` with row-wise scales takes x [M, K] and the fp8
    weight [N, K] where they sit."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    if torch.version.hip is not None:
        # ROCm's fp8 encoding differs by chip (e4m3fnuz on MI300); the reference
        # path serves there until a ROCm GPU has checked this one.
        return False
    if not hasattr(torch, "_scaled_mm"):
        return False
    out_features, in_features = weight.shape
    if in_features % SCALED_MM_ALIGNMENT or out_features % SCALED_MM_ALIGNMENT:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) in x's dtype, for e4m3 `weight` [N, K] with fp32
    `weight_scale` [N, 1]; x is quantized per token (module docstring)."""
    rows = x.reshape(-1, x.shape[-1])
    if scaled_mm_runs(rows, weight):
        codes, scale = quantize_activations(rows)
        y = torch._scaled_mm(
            codes,
            weight.t(),
            scale_a=scale,
            scale_b=weight_scale.t(),
            out_dtype=torch.bfloat16,
        )
    else:
        y = F.linear(round_trip_rows(rows), dequantize_rows(weight, weight_scale))
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _scale_parameter(module: nn.Module, source: str) -> None:
    """Declare `module.<source>_scale`, one fp32 scale per output row of parameter
    `source`, on its device; computed after loading, so the strict loader accounts
    for it through `quantized_from` instead of the checkpoint."""
    weight = getattr(module, source)
    shape = (*weight.shape[:-1], 1)
    scale = torch.ones(shape, dtype=torch.float32, device=weight.device)
    parameter = nn.Parameter(scale, requires_grad=False)
    parameter.quantized_from = source
    setattr(module, f"{source}_scale", parameter)


def _quantized_parameter(module: nn.Module, name: str) -> None:
    """Replace `module.<name>` by its e4m3 codes and fill `module.<name>_scale`."""
    codes, scale = quantize_rows(getattr(module, name).data)
    getattr(module, f"{name}_scale").data.copy_(scale)
    setattr(module, name, nn.Parameter(codes, requires_grad=False))


class PtpcFp8Linear:
    """The ptpc_fp8 method of a linear layer (`LinearBase.quant_method`)."""

    def prepare(self, module: nn.Module) -> None:
        """Before loading: the weight loads as usual; its scale is declared."""
        _scale_parameter(module, "weight")

    def finish(self, module: nn.Module) -> None:
        _quantized_parameter(module, "weight")

    def apply(
        self, module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return fp8_linear(x, module.weight, module.weight_scale, bias)


def fp8_expert_mlp(
    x: torch.Tensor,
    choice: ExpertChoice,
    module: nn.Module,
    decode: bool | None = None,
    addend: torch.Tensor | Pending | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The routed experts of `module` (e4m3 w13, w2 and their scales) as fp8
    grouped GEMMs in Triton, [N, D] (+ addend) in `out_dtype` like
    `grouped_expert_mlp`: each projection quantizes its input rows per token and
    reads them with the weight codes. No host sync. `decode` as `fp8_expert_gemm`
    takes it."""
    from atom.kernels.expert_gemm import fp8_expert_gemm

    def product(name: str, act: GatedAct | None = None) -> GroupedProduct:
        weight, weight_scale = getattr(module, name), getattr(module, f"{name}_scale")

        def gemm(
            rows: torch.Tensor,
            groups: ExpertGroups,
            row_source: torch.Tensor | None,
        ) -> torch.Tensor:
            codes, scale = quantize_activations(rows)
            return fp8_expert_gemm(
                codes,
                scale,
                weight,
                weight_scale,
                groups.ends,
                row_source,
                out_dtype=x.dtype,
                decode=decode,
                tile_lists=groups.tile_lists,
                act=act,
            )

        return gemm

    # The fp8 grouped GEMM is the Triton one: it fuses the activation as well.
    gated_up = gated_up_product(lambda act: product("w13", act), module.act, "triton")
    return routed_mlp(
        x,
        choice,
        module.w13.shape[0],
        gated_up,
        product("w2"),
        addend,
        out_dtype,
    )


class PtpcFp8Experts:
    """The ptpc_fp8 method of the routed experts (`FusedExperts.quant_method`):
    w13 and w2 stacks in e4m3 with scales [E, out, 1]."""

    def __init__(self) -> None:
        # Whether the fp8 grouped GEMMs run these experts; decided in `finish`,
        # once the stacks sit on their device.
        self.kernels = False

    @property
    def graph_capturable(self) -> bool:
        """The kernels sync with nothing; the reference reads the used experts."""
        return self.kernels

    def prepare(self, module: nn.Module) -> None:
        for name in ("w13", "w2"):
            _scale_parameter(module, name)

    def finish(self, module: nn.Module) -> None:
        for name in ("w13", "w2"):
            _quantized_parameter(module, name)
        # The CPU keeps the reference, even where the interpreter could run them.
        device = module.w13.device
        self.kernels = device.type == "cuda" and triton_available(device)

    def apply(
        self,
        module: nn.Module,
        x: torch.Tensor,
        choice: ExpertChoice,
        addend: torch.Tensor | Pending | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        if self.kernels:
            return fp8_expert_mlp(x, choice, module, addend=addend, out_dtype=out_dtype)
        return self.reference(module, x, choice, addend, out_dtype)

    def reference(
        self,
        module: nn.Module,
        x: torch.Tensor,
        choice: ExpertChoice,
        addend: torch.Tensor | Pending | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Dequantize only the experts this step routes to."""
        used = choice.ids.unique()
        stacks = []
        for name in ("w13", "w2"):
            codes, scale = getattr(module, name), getattr(module, f"{name}_scale")
            stack = torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)
            stack[used] = dequantize_rows(codes[used], scale[used])
            stacks.append(stack)
        w13, w2 = stacks
        return grouped_expert_mlp(
            x.float(),
            choice,
            w13,
            w2,
            module.act,
            expert_path(w13, w2),
            row_transform=round_trip_rows,
            addend=addend,
            out_dtype=out_dtype,
        )
