"""Settings whose value is a JSON object: `--kv-transfer-config` and
`--online_quant_config`, given as JSON text on the command line or as a mapping
through the Python API."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def json_object(value: str | Mapping[str, Any], flag: str, example: str) -> dict:
    """`value` decoded when it is JSON text; a ValueError naming `flag` (and showing
    `example`) when it is not valid JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{flag} is not valid JSON ({err}); expected e.g. {example}"
            ) from None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{flag} must be a JSON object like {example}, "
            f"got {type(value).__name__}"
        )
    return dict(value)
