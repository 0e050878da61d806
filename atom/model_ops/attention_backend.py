"""Where paged attention runs: the torch reference everywhere, Triton kernels on CUDA.

An MLA backend takes one layer's forward: this step's queries split into the nope
and rope parts [N, h, *], its new latent rows [N, C + R] and the layer
(`LatentLayer`: its paged cache and the scale of its rows, `model_ops/paged_cache.py`,
`kv_b_proj`'s weight, v_dim and the softmax scale); it writes the rows to their
slots, attends every query row to the rows its sequence holds up to its own
position, and returns o [N, h, d_v] (fp32 or the model dtype). `Config.attention_backend` (`ATOM_ATTENTION_BACKEND=
auto|torch|triton`) picks one; auto is triton on CUDA, torch elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from atom.config import ATTENTION_BACKENDS
from atom.kernels import require_triton, triton_available
from atom.model_ops.paged_cache import gather_kv, read_back_kv, write_kv
from atom.model_ops.paged_mla import ABSORB_MAX_QUERY_LEN, latent_attention, split_kv_b
from atom.model_ops.visibility import causal_visibility
from atom.utils.forward_context import AttentionMetadata


@dataclass(frozen=True)
class LatentLayer:
    """What attention reads of one MLA layer: its paged cache (and the scale of
    its rows), `kv_b_proj`'s weight and the layer's constants."""

    kv_cache: torch.Tensor
    kv_scale: float
    kv_b_weight: torch.Tensor
    v_dim: int
    scale: float


class MLABackend(Protocol):
    name: str

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        layer: LatentLayer,
        metadata: AttentionMetadata,
    ) -> torch.Tensor: ...


class TorchMLABackend:
    """`paged_mla.latent_attention` over the gathered block tables (or, when no
    sequence has cached rows, over this forward's own rows)."""

    name = "torch"

    def forward(self, q_nope, q_pe, latent, layer, metadata):
        kv_cache, kv_scale = layer.kv_cache, layer.kv_scale
        write_kv(kv_cache, metadata.slot_mapping, latent, kv_scale)
        if metadata.all_fresh:
            # Nothing cached is older than this forward: attend to its own rows,
            # rounded through the cache dtype as a read-back would be.
            keys = metadata.pad(read_back_kv(latent, kv_cache, kv_scale, latent.dtype))
        else:
            keys = gather_kv(kv_cache, metadata.block_tables, kv_scale, latent.dtype)
        o = latent_attention(
            metadata.pad(q_nope),
            metadata.pad(q_pe),
            keys,
            layer.kv_b_weight,
            layer.v_dim,
            layer.scale,
            causal_visibility(metadata.query_positions, keys.shape[1]),
        )
        return metadata.unpad(o)


class TritonMLABackend:
    """Decode and verify rows through `atom/kernels/paged_mla_decode.py`, which
    reads only each sequence's live rows; prefill through `prefill_backend`."""

    name = "triton"

    def __init__(self, prefill_backend: MLABackend) -> None:
        from atom.kernels.paged_mla_decode import mla_decode

        self.prefill_backend = prefill_backend
        self._decode = mla_decode

    def forward(self, q_nope, q_pe, latent, layer, metadata):
        if metadata.all_fresh or metadata.max_query_len > ABSORB_MAX_QUERY_LEN:
            return self.prefill_backend.forward(q_nope, q_pe, latent, layer, metadata)
        write_kv(layer.kv_cache, metadata.slot_mapping, latent, layer.kv_scale)
        w_uk, w_uv = split_kv_b(layer.kv_b_weight, q_nope.shape[1], layer.v_dim)
        # The key up-projection folds into the query, the value one into the output.
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk.to(q_nope.dtype))
        o_latent = self._decode(
            metadata.pad(q_latent),
            metadata.pad(q_pe),
            layer.kv_cache,
            layer.kv_scale,
            metadata.block_tables,
            metadata.query_positions,
            layer.scale,
        )
        o = torch.einsum("bqhc,hvc->bqhv", o_latent.to(w_uv.dtype), w_uv)
        return metadata.unpad(o)


def select_mla_backend(device: torch.device | str, choice: str = "auto") -> MLABackend:
    """The MLA backend `choice` (`Config.attention_backend`) names for `device`."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {choice!r}; allowed: "
            f"{', '.join(ATTENTION_BACKENDS)}"
        )
    on_cuda = torch.device(device).type == "cuda"
    if choice == "torch" or (choice == "auto" and not on_cuda):
        return TorchMLABackend()
    if choice == "triton":
        require_triton(device, "the triton attention backend")
    if not triton_available(device):
        return TorchMLABackend()
    return TritonMLABackend(TorchMLABackend())
