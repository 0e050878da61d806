"""A short fingerprint of the model a node is about to load, compared across nodes.

Two nodes with different checkpoints would each load their own without error and
then serve garbage, since every rank trusts the tensors its stage receives. Each
node therefore reports the architecture, a hash of its config.json and a hash of
its checkpoint's tensor names, shapes and dtypes (read from the shard headers, so
no weight is loaded), for the target and for the draft.
"""

from __future__ import annotations

import hashlib
import json

from safetensors import safe_open

from atom.config import Config, HFConfig
from atom.model_loader.safetensors_io import checkpoint_files

# Hex digits kept of each hash: enough to tell checkpoints apart, short to print.
DIGEST_CHARS = 12


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def weights_digest(model_dir: str) -> str:
    """Hash of every tensor's name, shape and dtype in the checkpoint."""
    entries = []
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as shard:
            for name in shard.keys():
                piece = shard.get_slice(name)
                entries.append(f"{name}:{piece.get_shape()}:{piece.get_dtype()}")
    return _digest("\n".join(sorted(entries)))


def checkpoint_fingerprint(model_dir: str, hf_config: HFConfig) -> dict[str, str]:
    return {
        "architecture": hf_config.architecture,
        "config": _digest(json.dumps(hf_config, sort_keys=True)),
        "weights": weights_digest(model_dir),
    }


def model_fingerprint(config: Config) -> dict[str, dict[str, str] | None]:
    """The target's fingerprint and the draft's (None without a draft model)."""
    spec = config.speculative_config
    draft = None
    if spec is not None and spec.model:
        draft = checkpoint_fingerprint(spec.model, spec.draft_hf_config)
    return {
        "target": checkpoint_fingerprint(config.model, config.hf_config),
        "draft": draft,
    }
