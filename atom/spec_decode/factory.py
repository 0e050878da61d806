"""Which drafter serves which speculative method."""

from __future__ import annotations

from atom.config import Config
from atom.spec_decode.drafter import Drafter
from atom.spec_decode.dspark_drafter import DSparkDrafter

DRAFTERS: dict[str, type[Drafter]] = {"dspark": DSparkDrafter}


def build_drafter(config: Config) -> Drafter:
    """The drafter of the config's speculative method (not yet loaded)."""
    spec = config.speculative_config
    if spec is None:
        raise ValueError("the drafter needs a speculative_config with a draft model")
    # Config offers only SPECULATIVE_METHODS, the keys of DRAFTERS (a test holds
    # the two equal), so every method it accepts has a drafter.
    return DRAFTERS[spec.method](config)
