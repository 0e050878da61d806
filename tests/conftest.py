"""Fixtures shared by every test package."""

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread_torch():
    """The in-process engine and the golden model on one intra-op thread: on a
    shared 2-core machine, OpenMP threads spinning against rank processes or other
    jobs made these forwards up to 30x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
