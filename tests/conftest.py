"""Fixtures shared by every test package."""

import os

import pytest
import torch

# Without a GPU the Triton kernels (atom/kernels/) run under Triton's interpreter,
# which is chosen when a kernel is defined: set it before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def single_thread_torch():
    """Tiny models in this process on one intra-op thread, as every rank process
    runs them: their small ops gain nothing from threads, and on a shared 2-core
    machine OpenMP threads spinning against rank processes or other jobs made
    these forwards up to 100x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
