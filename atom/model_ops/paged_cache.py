"""Rows of a paged cache: every attention's KV rows are written and read here.

A cache is [num_blocks, block_size, D]: one row of width D per token (an MLA latent
row, a GQA layer's keys and values, a draft's context row). A sequence's block table
names its blocks in position order; slot = block * block_size + offset.

A cache is stored in the model dtype or, with `--kv-cache-dtype fp8`, in
float8_e4m3fn: a row is written as rows / scale (clamped to the e4m3 range) and read
back as stored * scale, where scale is the layer's (`PagedKVLayer.kv_scale`): the
checkpoint's `k_scale` / `v_scale` / `kv_scale` where it ships them
(`model_loader/kv_scales.py`), else `DEFAULT_KV_SCALE`.
"""

from __future__ import annotations

import torch

from atom.config import KV_CACHE_DTYPES

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = torch.finfo(FP8_KV_DTYPE).max
# The per-layer scale when the checkpoint has none: the projections' outputs (a
# normed latent, normed keys, values of the order of the hidden state) sit well
# inside e4m3's range of +-448, where its 3 mantissa bits give ~6% steps.
DEFAULT_KV_SCALE = 1.0


def resolve_kv_cache_dtype(name: str, device: torch.device | str) -> torch.dtype | None:
    """The storage dtype `--kv-cache-dtype name` means on `device` (None: the model
    dtype); refuses a name or a device that cannot hold it."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {name!r} is not supported; allowed: "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    if name == "auto":
        return None
    device = torch.device(device)
    if device.type == "cuda" and not _stores_e4m3(device):
        raise ValueError(
            f"--kv-cache-dtype {name} needs a GPU that loads float8 e4m3 natively "
            "(NVIDIA compute capability 8.9+, AMD gfx950+); "
            f"{torch.cuda.get_device_name(device)} does not: use --kv-cache-dtype auto"
        )
    return FP8_KV_DTYPE


def _stores_e4m3(device: torch.device) -> bool:
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        return arch.startswith(("gfx95", "gfx12"))
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _stored(cache: torch.Tensor) -> torch.Tensor:
    """The view that index kernels take: float8 has no CPU index_copy_ (nor, in
    every build, index_select), so its bytes move as uint8."""
    return cache.view(torch.uint8) if cache.dtype == FP8_KV_DTYPE else cache


def encode_kv(
    rows: torch.Tensor, cache_dtype: torch.dtype, scale: float
) -> torch.Tensor:
    """`rows` as a cache of `cache_dtype` stores them."""
    if cache_dtype != FP8_KV_DTYPE:
        return rows.to(cache_dtype)
    scaled = rows.float() / scale
    return scaled.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def decode_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored cache rows as values of `dtype`."""
    if stored.dtype != FP8_KV_DTYPE:
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)


def read_back_kv(
    rows: torch.Tensor, cache: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """`rows` as writing them to `cache` and reading them back would give: what a
    forward attends to for rows it does not read from the cache. Differentiable
    through a model-dtype cache (the training tools prefill through it)."""
    return decode_kv(encode_kv(rows, cache.dtype, scale), scale, dtype)


def write_kv(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
) -> None:
    """Store `rows` [N, D] at flat slots (block * block_size + offset), encoded
    with the layer's `scale` when the cache is fp8.

    Caches hold values only: what is written carries no autograd history.
    """
    stored = encode_kv(rows.detach(), kv_cache.dtype, scale)
    flat = _stored(kv_cache).view(-1, kv_cache.shape[-1])
    flat.index_copy_(0, slot_mapping, _stored(stored))


def gather_kv(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[B, W * block_size, D] of `dtype`: every sequence's cached rows in position
    order."""
    num_seqs, width = block_tables.shape
    rows = _stored(kv_cache).index_select(0, block_tables.reshape(-1))
    rows = rows.view(kv_cache.dtype).view(
        num_seqs, width * kv_cache.shape[1], kv_cache.shape[2]
    )
    return decode_kv(rows, scale, dtype)
