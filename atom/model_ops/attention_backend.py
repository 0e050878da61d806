"""Where paged attention runs: the torch reference everywhere, Triton kernels on CUDA.

An MLA backend takes one layer's forward: this step's queries split into the nope
and rope parts [N, h, *], its new latent rows [N, C + R] and the layer
(`LatentLayer`: its paged cache and the scale of its rows, `model_ops/paged_cache.py`,
`kv_b_proj`'s weight, v_dim and the softmax scale); it writes the rows to their
slots, attends every query row to the rows its sequence holds up to its own
position, and returns o [N, h, d_v] (fp32 or the model dtype). `Config.attention_backend` (`ATOM_ATTENTION_BACKEND=
auto|torch|triton`) picks one; auto is triton on CUDA, torch elsewhere.

A GQA backend takes one layer's forward the same way: queries [N, hq, d], the new
cache rows [N, k | v | index key] and, on block-sparse layers, the index queries
[N, G, di], with the layer (`GQALayer`); it writes the rows, lets the indexer choose
each KV group's key blocks where the layer has one (`block_sparse.py`), attends
every query row to its sequence's visible keys (`visibility.sequence_visibility`)
and returns o [N, hq, d]. The same setting picks it (`select_gqa_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from atom.config import ATTENTION_BACKENDS
from atom.kernels import require_triton, triton_available
from atom.model_ops.block_sparse import (
    IndexerConfig,
    block_sparse_visibility,
    kept_blocks,
)
from atom.model_ops.paged_attention import gqa_attention
from atom.model_ops.paged_cache import gather_kv, read_back_kv, write_kv
from atom.model_ops.paged_mla import ABSORB_MAX_QUERY_LEN, latent_attention, split_kv_b
from atom.model_ops.visibility import (
    causal_visibility,
    sequence_key_ends,
    sequence_visibility,
)
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


def write_and_gather(
    rows: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: float,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Write this forward's cache rows [N, W] to their slots, then return every
    sequence's rows [B, S, W] in rows' dtype, as the torch backends attend to them:
    the gathered block tables or, when no sequence has cached rows, this forward's
    own rows rounded through the cache dtype as a read-back would be."""
    write_kv(kv_cache, metadata.slot_mapping, rows, kv_scale)
    if metadata.all_fresh:
        return metadata.pad(read_back_kv(rows, kv_cache, kv_scale, rows.dtype))
    return gather_kv(kv_cache, metadata.block_tables, kv_scale, rows.dtype)


class TorchMLABackend:
    """`paged_mla.latent_attention` over the gathered block tables (or, when no
    sequence has cached rows, over this forward's own rows)."""

    name = "torch"

    def forward(self, q_nope, q_pe, latent, layer, metadata):
        keys = write_and_gather(latent, layer.kv_cache, layer.kv_scale, metadata)
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


def _uses_triton(device: torch.device | str, choice: str) -> bool:
    """Whether `choice` (`Config.attention_backend`) means the Triton kernels on
    `device`; refuses an unknown choice, and triton where it cannot run."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {choice!r}; allowed: "
            f"{', '.join(ATTENTION_BACKENDS)}"
        )
    on_cuda = torch.device(device).type == "cuda"
    if choice == "torch" or (choice == "auto" and not on_cuda):
        return False
    if choice == "triton":
        require_triton(device, "the triton attention backend")
    return triton_available(device)


def select_mla_backend(device: torch.device | str, choice: str = "auto") -> MLABackend:
    """The MLA backend `choice` (`Config.attention_backend`) names for `device`."""
    if not _uses_triton(device, choice):
        return TorchMLABackend()
    return TritonMLABackend(TorchMLABackend())


# Rows per sequence up to which the GQA decode kernel (which walks a sequence's
# keys once per query row) takes a forward: decode and DSpark verify rows.
GQA_DECODE_MAX_QUERY_LEN = 16


@dataclass(frozen=True)
class GQALayer:
    """What attention reads of one GQA layer: its paged cache of rows
    [k (kv_heads * d) | v (kv_heads * d) | index key (sparse layers)], the scale of
    its rows, its local KV heads, head_dim, softmax scale and indexer (or None)."""

    kv_cache: torch.Tensor
    kv_scale: float
    num_kv_heads: int
    head_dim: int
    scale: float
    indexer: IndexerConfig | None

    @property
    def kv_width(self) -> int:
        """Elements of a row's keys (and of its values)."""
        return self.num_kv_heads * self.head_dim

    @property
    def index_width(self) -> int:
        return self.indexer.head_dim if self.indexer is not None else 0


class GQABackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        index_q: torch.Tensor | None,
        layer: GQALayer,
        metadata: AttentionMetadata,
    ) -> torch.Tensor: ...


class TorchGQABackend:
    """`paged_attention.gqa_attention` over the gathered block tables (or, when no
    sequence has cached rows, over this forward's own rows), block-sparse layers
    masked by `block_sparse.block_sparse_visibility`."""

    name = "torch"

    def forward(self, q, rows, index_q, layer, metadata):
        keys = write_and_gather(rows, layer.kv_cache, layer.kv_scale, metadata)
        visible = sequence_visibility(metadata, keys.shape[1])
        width = layer.kv_width
        k, v, index_k = keys.split([width, width, layer.index_width], dim=-1)
        if layer.indexer is None:
            visible = visible.unsqueeze(1)
        else:
            visible = block_sparse_visibility(
                metadata.pad(index_q),
                index_k,
                visible,
                metadata.query_positions,
                layer.indexer,
            )
        heads = (layer.num_kv_heads, layer.head_dim)
        o = gqa_attention(
            metadata.pad(q),
            k.unflatten(-1, heads),
            v.unflatten(-1, heads),
            visible,
            layer.scale,
        )
        return metadata.unpad(o)


class TritonGQABackend:
    """Decode and verify rows through `atom/kernels/paged_gqa_decode.py` (and the
    indexer's block scores through `paged_index_scores.py`), which read only each
    sequence's live rows; prefill through `prefill_backend`."""

    name = "triton"

    def __init__(self, prefill_backend: GQABackend) -> None:
        from atom.kernels.paged_gqa_decode import gqa_decode
        from atom.kernels.paged_index_scores import index_block_scores

        self.prefill_backend = prefill_backend
        self._decode = gqa_decode
        self._index_scores = index_block_scores

    def forward(self, q, rows, index_q, layer, metadata):
        if metadata.all_fresh or metadata.max_query_len > GQA_DECODE_MAX_QUERY_LEN:
            return self.prefill_backend.forward(q, rows, index_q, layer, metadata)
        kv_cache, kv_scale = layer.kv_cache, layer.kv_scale
        write_kv(kv_cache, metadata.slot_mapping, rows, kv_scale)
        tables, positions = metadata.block_tables, metadata.query_positions
        key_ends = sequence_key_ends(metadata)
        keep, sparse_block_size = None, 1
        if layer.indexer is not None:
            sparse_block_size = layer.indexer.block_size
            scores = self._index_scores(
                metadata.pad(index_q),
                kv_cache,
                kv_scale,
                tables,
                positions,
                key_ends,
                2 * layer.kv_width,
                sparse_block_size,
            )
            keep = kept_blocks(scores, positions, layer.indexer)
        o = self._decode(
            metadata.pad(q),
            kv_cache,
            kv_scale,
            tables,
            positions,
            key_ends,
            layer.num_kv_heads,
            0,
            layer.kv_width,
            layer.scale,
            keep,
            sparse_block_size,
        )
        return metadata.unpad(o)


def select_gqa_backend(device: torch.device | str, choice: str = "auto") -> GQABackend:
    """The GQA backend `choice` (`Config.attention_backend`) names for `device`."""
    if not _uses_triton(device, choice):
        return TorchGQABackend()
    return TritonGQABackend(TorchGQABackend())
