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
    drafter_class = DRAFTERS.get(spec.canonical_method)
    if drafter_class is None:
        raise ValueError(
            f"speculative method {spec.method!r} has no drafter here; implemented: "
            f"{', '.join(DRAFTERS)}"
        )
    return drafter_class(config)
