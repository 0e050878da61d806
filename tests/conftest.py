"""Fixtures shared by every test package."""

import pytest
import torch


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
