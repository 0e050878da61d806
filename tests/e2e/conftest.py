"""Fixtures of the end-to-end engine tests."""

import pytest
import torch

from tests.e2e.engine_helpers import GoldenOracle


@pytest.fixture(scope="session")
def golden_oracle() -> GoldenOracle:
    """One oracle per session: the golden model recomputes every token from scratch
    (seconds per K3 prompt), so each continuation is computed once for all layouts."""
    return GoldenOracle()


@pytest.fixture(scope="module")
def single_thread_torch():
    """The in-process engine and the golden model on one intra-op thread: on a
    shared 2-core machine, OpenMP threads spinning against rank processes or other
    jobs made these forwards up to 30x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
