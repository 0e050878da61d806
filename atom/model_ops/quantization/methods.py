"""What a quantization method gives a module, and which method each scheme names.

A method is set on a module before loading (`prepare`: declare the parameters it
adds), converts the loaded weights (`finish`) and runs the module's product
(`apply`). The modules keep their own loaders: weights arrive in the model dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from atom.model_ops.grouped_experts import ExpertChoice
from atom.model_ops.quantization.config import PTPC_FP8
from atom.model_ops.quantization.ptpc_fp8 import PtpcFp8Experts, PtpcFp8Linear
from atom.model_ops.side_stream import Pending


class LinearMethod(Protocol):
    def prepare(self, module: nn.Module) -> None: ...

    def finish(self, module: nn.Module) -> None: ...

    def apply(
        self, module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...


class ExpertsMethod(Protocol):
    @property
    def graph_capturable(self) -> bool: ...

    def prepare(self, module: nn.Module) -> None: ...

    def finish(self, module: nn.Module) -> None: ...

    def apply(
        self,
        module: nn.Module,
        x: torch.Tensor,
        choice: ExpertChoice,
        addend: torch.Tensor | Pending | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor: ...


# Online scheme -> (linear method, experts method) classes.
ONLINE_METHODS: dict[str, tuple[type[LinearMethod], type[ExpertsMethod]]] = {
    PTPC_FP8: (PtpcFp8Linear, PtpcFp8Experts),
}
