"""Triton kernels of the hot path, each beside the torch function it must equal.

Every kernel module exposes a plain function with the same contract as a torch
reference elsewhere in `atom.model_ops`; the tests compare the two at small shapes,
natively on CUDA and on CPU through Triton's interpreter (`TRITON_INTERPRET=1`).
Triton is optional: `triton_available()` says whether these kernels can run here,
and callers fall back to the torch references when they cannot.
`ATOM_DISABLE_TRITON=1` makes it say no everywhere, so every op runs its torch
reference (an end-to-end comparison on a GPU, or a way around a kernel that fails).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

DISABLE_ENV = "ATOM_DISABLE_TRITON"


@functools.cache
def triton_installed() -> bool:
    # Asked on every eager forward: the import system's answer does not change.
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton's interpreter runs kernels on the CPU with numpy (tests only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(device: torch.device | str) -> bool:
    """Whether the kernels of this package can run on tensors of `device`: natively
    on a CUDA (or ROCm) GPU, or on the CPU under the interpreter."""
    if not triton_installed() or os.environ.get(DISABLE_ENV) == "1":
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and interpreting())


def require_triton(device: torch.device | str, what: str) -> None:
    """A ValueError naming `what` when these kernels cannot run on `device`."""
    if not triton_available(device):
        off = (
            f" and {DISABLE_ENV}=1 turns it off"
            if os.environ.get(DISABLE_ENV) == "1"
            else ""
        )
        raise ValueError(
            f"{what} needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU), "
            f"got {device}{off}"
        )


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessors (grids are sized to fill them); 4 under the
    interpreter, where any count gives the same numbers."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_per_chunk(block_e: int) -> int:
    """Rows a one-program kernel takes per chunk of a [rows, experts] comparison
    (the expert GEMM's tile list): about 16K elements at a time
    keeps the registers in bounds."""
    return max(16, min(128, 16384 // block_e))
