"""transformers' kimi_linear tensor names -> the published checkpoint names.

transformers 5.24 fuses and renames Kimi Linear tensors at load time (its
`conversion_mapping` "kimi_linear"); `save_pretrained` reverses that, except that the
reversal also renames a *dense* layer's `mlp.{gate,up,down}_proj` to
`block_sparse_moe.*`. This module maps either spelling (an in-memory `state_dict()` or a
`save_pretrained` folder) onto the checkpoint names atom loads:

| transformers | checkpoint |
|---|---|
| `self_attn.forget_gate.{f_a_proj.weight, f_b_proj.weight, dt_bias, A_log}` | `self_attn.*` |
| `self_attn.conv1d.weight` `[3P, 1, K]` | `self_attn.{q,k,v}_conv1d.weight` `[P, 1, K]` |
| `mlp.experts.gate_up_proj` `[E, 2I, H]` (gate first) | `block_sparse_moe.experts.{e}.w1/.w3.weight` |
| `mlp.experts.down_proj` `[E, H, I]` | `block_sparse_moe.experts.{e}.w2.weight` |
| `mlp.{gate, shared_experts}.*` (sparse layers) | `block_sparse_moe.*` |
| `block_sparse_moe.{gate,up,down}_proj.weight` (dense, as saved) | `mlp.*` |

Names already in checkpoint form pass through unchanged, so the map is idempotent.
"""

import re

import torch

_FORGET_GATE = re.compile(r"\.self_attn\.forget_gate\.")
_FUSED_CONV = re.compile(r"\.self_attn\.conv1d\.weight$")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_SPARSE_MLP = re.compile(r"\.mlp\.(gate|shared_experts)\.")
_DENSE_SAVED_AS_MOE = re.compile(r"\.block_sparse_moe\.((gate|up|down)_proj\.weight)$")


def to_checkpoint_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename and split a kimi_linear state dict into checkpoint tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        for new_name, new_tensor in _convert(name, tensor):
            if new_name in out:
                raise ValueError(f"two tensors map to checkpoint name {new_name!r}")
            out[new_name] = new_tensor
    return out


def _convert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    if _FUSED_CONV.search(name):
        if tensor.shape[0] % 3:
            raise ValueError(f"{name}: {tuple(tensor.shape)} does not stack q, k, v")
        base = name.removesuffix("conv1d.weight")
        return [
            (f"{base}{part}_conv1d.weight", chunk.contiguous())
            for part, chunk in zip("qkv", tensor.chunk(3))
        ]
    match = _FUSED_EXPERTS.search(name)
    if match:
        return _split_experts(name[: match.start()], match.group(1), tensor)
    name = _FORGET_GATE.sub(".self_attn.", name)
    name = _SPARSE_MLP.sub(r".block_sparse_moe.\1.", name)
    name = _DENSE_SAVED_AS_MOE.sub(r".mlp.\1", name)
    return [(name, tensor)]


def _split_experts(
    layer: str, kind: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """[E, ...] fused experts -> per-expert w1/w3 (gate_up) or w2 (down)."""
    if tensor.dim() != 3:
        raise ValueError(
            f"{layer}.mlp.experts.{kind} must be 3-D, got {tensor.dim()}-D"
        )
    prefix = f"{layer}.block_sparse_moe.experts."
    out = []
    for e, expert in enumerate(tensor):
        if kind == "down_proj":
            out.append((f"{prefix}{e}.w2.weight", expert.contiguous()))
            continue
        if expert.shape[0] % 2:
            raise ValueError(f"{prefix}{e}: odd gate_up rows {expert.shape[0]}")
        gate, up = expert.chunk(2)
        out.append((f"{prefix}{e}.w1.weight", gate.contiguous()))
        out.append((f"{prefix}{e}.w3.weight", up.contiguous()))
    return out
