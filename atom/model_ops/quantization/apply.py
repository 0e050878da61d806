"""Gives each linear and expert module of a built model its quantization.

`prepare_quantization` runs after a model is built and before it loads: routed
experts the checkpoint stores as MXFP4 expect their packed halves, and under an online
scheme every other linear and expert module gets that scheme's method (which declares
its scale parameters). `finish_quantization` runs once loading accounted for every
weight and converts them. Linears whose weight a model reads outside their forward
(named in a module's `full_precision_linears`) stay in the model dtype, as do
embeddings, norms, router gates and the LM head, which are not linear layers here.
"""

from __future__ import annotations

from torch import nn

from atom.model_ops.linear import LinearBase
from atom.model_ops.quantization.config import QuantizationConfig
from atom.model_ops.quantization.methods import ONLINE_METHODS
from atom.model_ops.quantization.mxfp4 import declares_mxfp4
from atom.model_ops.routed_experts import FusedExperts


def full_precision_names(model: nn.Module) -> set[str]:
    """Attribute names of linears kept in the model dtype, as modules declare them."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "full_precision_linears", ()))
    return names


def declare_checkpoint_experts(
    model: nn.Module, quantization: QuantizationConfig, prefix: str = ""
) -> None:
    """Expect MXFP4 halves for the routed experts the checkpoint stores as MXFP4;
    checked on expert 0's w1, named as in the checkpoint (`prefix`)."""
    for name, module in model.named_modules(prefix=prefix):
        if isinstance(module, FusedExperts):
            if declares_mxfp4(quantization.checkpoint, f"{name}.0.w1"):
                module.expect_mxfp4()


def prepare_quantization(model: nn.Module, quantization: QuantizationConfig) -> None:
    """Set the online scheme's methods on `model`'s modules (before loading).
    Experts expecting MXFP4 keep the checkpoint's form."""
    if quantization.online_scheme is None:
        return
    linear_method, experts_method = ONLINE_METHODS[quantization.online_scheme]
    keep = full_precision_names(model)
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            if not module.expects_mxfp4:
                module.quant_method = experts_method()
        elif isinstance(module, LinearBase):
            if name.rsplit(".", 1)[-1] not in keep:
                module.quant_method = linear_method()
        else:
            continue
        if module.quant_method is not None:
            module.quant_method.prepare(module)


def finish_quantization(model: nn.Module) -> None:
    """Convert the loaded weights of every module with a method (after loading)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.finish(module)
