"""The API key of a deployment: what a server requires and what its peers send.

Every atom process reads it from one environment variable, so that the servers of a
P/D deployment, the router in front of them and the consumer's side channel to its
producers agree on it without the key appearing on a command line.
"""

from __future__ import annotations

import os

API_KEY_ENV = "ATOM_API_KEY"


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """The request headers that present `api_key` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
