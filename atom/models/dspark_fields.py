"""Checks every DSpark draft config makes, whatever its architecture.

Torch-free: the registry reads draft configs before any model is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def check_taps_and_mask(
    tap_ids: tuple[int, ...],
    target_depth: int,
    depth_field: str,
    mask_token_id: int,
    vocab_size: int,
) -> None:
    """Refuse tap ids that are empty, out of order or outside the target (-1 is the
    embedding output), and a mask token outside the vocabulary."""
    if not tap_ids or any(b <= a for a, b in zip(tap_ids, tap_ids[1:])):
        raise ValueError(
            f"target_layer_ids {list(tap_ids)} must be non-empty and strictly "
            "increasing"
        )
    bad = [i for i in tap_ids if not -1 <= i < target_depth]
    if bad:
        raise ValueError(
            f"target_layer_ids {bad} lie outside {{-1}} and [0, {target_depth}) "
            f"({depth_field})"
        )
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(
            f"mask_token_id {mask_token_id} is outside the vocabulary "
            f"[0, {vocab_size})"
        )


def check_matches_target(
    checks: Iterable[tuple[str, int, str]], target: Mapping[str, Any]
) -> None:
    """Each (draft field, draft value, target field) must agree with the target's
    text config."""
    for draft_name, value, target_name in checks:
        actual = target.get(target_name)
        if actual is None or int(actual) != value:
            raise ValueError(
                f"draft {draft_name}={value} does not match the target's "
                f"{target_name}={actual}"
            )
