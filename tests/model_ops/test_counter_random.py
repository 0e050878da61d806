"""The counter-based random source: exact bits, uniformity, independent streams.

Statistical checks use fixed seeds, so their outcome never changes between runs;
thresholds are chi-square 1 - 1e-4 quantiles.
"""

import pytest
import torch
from scipy.stats import chi2

from atom.model_ops.counter_random import Stream, uniform, uniforms

MASK = (1 << 64) - 1


def reference_mix(x: int) -> int:
    """splitmix64's finaliser on Python integers (unbounded, masked to 64 bits)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def reference_uniform(seed: int, position: int, stream: int, index: int) -> float:
    key = reference_mix(reference_mix(reference_mix(seed) ^ stream) ^ position)
    word = reference_mix((key + (index + 1) * 0x9E3779B97F4A7C15) & MASK)
    return (2 * (word >> 41) + 1) / 2**24


def chi_square_uniform(values: torch.Tensor, bins: int) -> float:
    counts = torch.histc(values.double(), bins=bins, min=0, max=1)
    expected = values.numel() / bins
    return float(((counts - expected) ** 2 / expected).sum())


def test_bits_match_a_python_reference_including_extreme_seeds():
    seeds = [0, 1, 2**31, 2**62 + 12345, 2**63 - 1]
    positions = [0, 7, 2**20, 2**40 + 3, 123456789]
    got = uniforms(torch.tensor(seeds), torch.tensor(positions), Stream.RESIDUAL, 6)
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        expected = [
            reference_uniform(seed, position, int(Stream.RESIDUAL), i) for i in range(6)
        ]
        assert got[row].tolist() == expected


def test_values_lie_strictly_inside_the_unit_interval():
    u = uniforms(torch.arange(64), torch.arange(64), Stream.TARGET, 4096)
    assert u.dtype == torch.float32
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert float((-torch.log(u)).min()) > 0  # exponential draws are finite, positive


def test_uniformity():
    u = uniforms(torch.arange(50), torch.full((50,), 9), Stream.TARGET, 4000)
    assert chi_square_uniform(u.flatten(), 100) < chi2.ppf(1 - 1e-4, df=99)
    assert abs(float(u.mean()) - 0.5) < 0.002
    # One draw per decision across seeds and positions is uniform too.
    scalars = uniform(torch.arange(200000), torch.arange(200000) % 97, Stream.ACCEPT)
    assert chi_square_uniform(scalars, 50) < chi2.ppf(1 - 1e-4, df=49)


@pytest.mark.parametrize(
    "first, second",
    [
        ((Stream.ACCEPT, 0, 0), (Stream.RESIDUAL, 0, 0)),  # streams
        ((Stream.TARGET, 0, 0), (Stream.DRAFT, 0, 0)),
        ((Stream.ACCEPT, 0, 0), (Stream.ACCEPT, 1, 0)),  # neighbouring positions
        ((Stream.ACCEPT, 0, 0), (Stream.ACCEPT, 0, 1)),  # neighbouring seeds
    ],
)
def test_neighbouring_decisions_are_independent(first, second):
    """Pairs (u, v) of the same seeds are uniform on the unit square (8 x 8 cells)."""
    seeds = torch.arange(100000)
    positions = seeds % 1000

    def draw(stream, position_shift, seed_shift):
        return uniform(seeds + seed_shift, positions + position_shift, stream)

    u, v = draw(*first), draw(*second)
    cells = (u * 8).long() * 8 + (v * 8).long()
    counts = torch.bincount(cells, minlength=64).double()
    expected = seeds.numel() / 64
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < chi2.ppf(1 - 1e-4, df=63)
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.02


def test_a_decision_draws_the_same_alone_and_in_a_batch():
    seeds, positions = torch.tensor([5, 2**63 - 1, 77]), torch.tensor([3, 40, 1000])
    streams = torch.tensor([1, 3, 4])
    batch = uniforms(seeds, positions, streams, 32)
    for row in range(3):
        alone = uniforms(
            seeds[row : row + 1], positions[row : row + 1], int(streams[row]), 32
        )
        assert torch.equal(alone[0], batch[row])
    # A narrower draw is a prefix of a wider one; a scalar draw is entry 0.
    assert torch.equal(uniforms(seeds, positions, streams, 5), batch[:, :5])
    assert torch.equal(uniform(seeds, positions, streams), batch[:, 0])


def test_seeds_positions_and_streams_all_change_the_numbers():
    base = uniforms(torch.tensor([1]), torch.tensor([2]), Stream.TARGET, 16)
    for seed, position, stream in ((2, 2, 1), (1, 3, 1), (1, 2, 2)):
        other = uniforms(torch.tensor([seed]), torch.tensor([position]), stream, 16)
        assert not torch.equal(base, other)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_the_same_bits_as_cpu():
    seeds = torch.tensor([0, 3, 2**63 - 1, 2**40])
    positions = torch.tensor([0, 17, 5, 2**33])
    cpu = uniforms(seeds, positions, Stream.DRAFT, 163840)
    cuda = uniforms(seeds.cuda(), positions.cuda(), Stream.DRAFT, 163840)
    assert torch.equal(cpu, cuda.cpu())
