"""Fixtures of the end-to-end engine tests."""

import pytest

from tests.e2e.engine_helpers import GoldenOracle


@pytest.fixture(scope="session")
def golden_oracle() -> GoldenOracle:
    """One oracle per session: the golden model recomputes every token from scratch
    (seconds per K3 prompt), so each continuation is computed once for all layouts."""
    return GoldenOracle()
