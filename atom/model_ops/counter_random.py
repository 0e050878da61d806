"""Counter-based random numbers: a uniform is a pure function of its coordinates.

u = f(request seed, position, stream, index) with splitmix64's mixing function on
int64 tensors. Nothing is stateful, so a seeded request draws the same numbers
whatever batch it sits in, on every TP rank, on CPU and CUDA alike (the integer
arithmetic is exact on both), and no per-request generator object is kept.

`position` is the sequence position of the token being decided, `stream` says what
the number is for (see `Stream`), `index` enumerates the numbers of one decision
(one per vocabulary entry for a token draw). Every token position is decided once,
so numbers are never reused for two decisions that must be independent.
"""

from __future__ import annotations

from enum import IntEnum

import torch


class Stream(IntEnum):
    """What a uniform is used for; each value is an independent stream."""

    # Plain sampling of the next token (no drafts verified).
    TARGET = 1
    # u_j of the accept test u_j * q_j(d_j) < p_j(d_j).
    ACCEPT = 2
    # The token emitted after a rejection (residual) or after full acceptance (bonus).
    RESIDUAL = 3
    # The draft's own sampling of its Markov head.
    DRAFT = 4


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN_GAMMA = _signed(0x9E3779B97F4A7C15)
MIX_1 = _signed(0xBF58476D1CE4E5B9)
MIX_2 = _signed(0x94D049BB133111EB)
# Uniforms are odd multiples of 2**-24 in (0, 1): 23 random bits, all of them exact
# in float32, and never 0 or 1 (so -log(u) is finite and positive).
UNIFORM_BITS = 23


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; clear the copies of the sign bit.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words (int64 wraps on overflow)."""
    x = x ^ _shift_right(x, 30)
    x = x * MIX_1
    x = x ^ _shift_right(x, 27)
    x = x * MIX_2
    return x ^ _shift_right(x, 31)


def decision_keys(
    seeds: torch.Tensor, positions: torch.Tensor, streams: torch.Tensor | int
) -> torch.Tensor:
    """One 64-bit key per (seed, position, stream), broadcast together."""
    if not isinstance(streams, torch.Tensor):
        streams = int(streams)  # a Python scalar: no host-to-device copy
    key = mix64(mix64(seeds.long()) ^ streams)
    return mix64(key ^ positions.long())


def uniforms(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    streams: torch.Tensor | int,
    width: int,
) -> torch.Tensor:
    """float32 uniforms in (0, 1), shape broadcast(seeds, positions, streams) + [width].

    Entry i is the i-th number of the splitmix64 sequence started at the decision's
    key, so a prefix of a wider draw equals a narrower draw.
    """
    key = decision_keys(seeds, positions, streams).unsqueeze(-1)
    index = torch.arange(1, width + 1, dtype=torch.long, device=key.device)
    bits = _shift_right(mix64(key + index * GOLDEN_GAMMA), 64 - UNIFORM_BITS)
    return (2 * bits + 1).float() * 2.0 ** -(UNIFORM_BITS + 1)


def uniform(
    seeds: torch.Tensor, positions: torch.Tensor, streams: torch.Tensor | int
) -> torch.Tensor:
    """One uniform per decision: the first entry of `uniforms`."""
    return uniforms(seeds, positions, streams, 1).squeeze(-1)
