"""Kimi Delta Attention (KDA) math for one sequence, all heads at once (spec 4.3).

Layouts: tokens first (`[T, h, D]`), recurrent state value-first `[h, Dv, Dk]` in fp32.
The token loop `recurrent_kda` is the correctness oracle; `chunk_kda` is the chunked
(WY / UT-transform) form used for prefill and must agree with it.
"""

import torch
import torch.nn.functional as F

# Inside a chunk, decayed scores are built in sub-blocks of this many rows, so the
# pairwise decay tensor stays small ([h, sub, sub, Dk]) while every exponent is <= 0.
_SUB_BLOCK = 16


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp of an fp64 difference of cumulative log-decays, as fp32.

    Cumulative sums are kept in fp64 because a chunk's sum can reach -1e4 (Kimi Linear
    gates), where fp32 differences of nearby rows would lose the small per-token decays.
    """
    return torch.exp(log_decay.float())


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(||x||^2 + eps)` over the last axis, in fp32 (fp32 result)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_forget_gate(
    f: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
) -> torch.Tensor:
    """Per-channel log-decay g of shape [T, h, D] in fp32.

    `f` is `W_fb(W_fa x)` viewed as [T, h, D]; `dt_bias` is added here in fp32.
    K3 (lower_bound set): `lb * sigmoid(exp(A_log) * (f + dt_bias))`, in (lb, 0).
    Kimi Linear: `-exp(A_log) * softplus(f + dt_bias)`, softplus linear above 20.
    `a_log` may be [n] or legacy [1, 1, n, 1] with n >= h; the first h entries are used
    (under TP the caller passes this rank's heads).
    """
    if f.dim() != 3:
        raise ValueError(f"f must be [T, heads, head_dim], got {tuple(f.shape)}")
    heads, head_dim = f.shape[1], f.shape[2]
    a_flat = a_log.reshape(-1)
    if a_flat.numel() < heads:
        raise ValueError(
            f"A_log has {a_flat.numel()} entries, fewer than {heads} heads"
        )
    if dt_bias.numel() != heads * head_dim:
        raise ValueError(
            f"dt_bias has {dt_bias.numel()} entries, expected heads*head_dim = "
            f"{heads * head_dim}"
        )
    decay_rate = torch.exp(a_flat[:heads].float()).view(1, heads, 1)
    pre = f.float() + dt_bias.float().view(1, heads, head_dim)
    if lower_bound is None:
        return -decay_rate * F.softplus(pre, beta=1.0, threshold=20.0)
    if not lower_bound < 0:
        raise ValueError(f"gate lower_bound must be negative, got {lower_bound}")
    return lower_bound * torch.sigmoid(decay_rate * pre)


def _conv_padded_input(
    x: torch.Tensor, conv_state: torch.Tensor | None, kernel_size: int
) -> torch.Tensor:
    """[K-1+T, C] fp32: the cached inputs (or zeros) followed by x."""
    channels = x.shape[1]
    if conv_state is None:
        history = x.new_zeros(kernel_size - 1, channels, dtype=torch.float32)
    else:
        if tuple(conv_state.shape) != (channels, kernel_size - 1):
            raise ValueError(
                f"conv_state must be [{channels}, {kernel_size - 1}], "
                f"got {tuple(conv_state.shape)}"
            )
        history = conv_state.float().t()
    return torch.cat([history, x.float()], dim=0)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (no bias) + SiLU over x [T, C] with weight [C, K].

    Inputs before the first row come from conv_state [C, K-1] (zeros if None).
    Returns (y [T, C] in x.dtype, new_state [C, K-1] = last K-1 pre-conv inputs).
    A checkpoint weight [C, 1, K] is accepted too.
    """
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0, :]
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"expected x [T, C] and weight [C, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    channels, kernel_size = weight.shape
    padded = _conv_padded_input(x, conv_state, kernel_size)
    y = F.conv1d(padded.t().unsqueeze(0), weight.float().unsqueeze(1), groups=channels)
    y = F.silu(y[0].t())
    new_state = padded[padded.shape[0] - (kernel_size - 1) :].t()
    return y.to(x.dtype), new_state.to(x.dtype).contiguous()


def conv_state_after_each_row(
    x: torch.Tensor, conv_state: torch.Tensor
) -> torch.Tensor:
    """[T, C, K-1]: the conv state after consuming rows 0..j of x [T, C], for each j.

    Speculative verify commits the state after the last accepted row.
    """
    if x.dim() != 2 or conv_state.dim() != 2:
        raise ValueError(
            f"expected x [T, C] and conv_state [C, K-1], got {tuple(x.shape)} and "
            f"{tuple(conv_state.shape)}"
        )
    width = conv_state.shape[1]
    padded = _conv_padded_input(x, conv_state, width + 1)
    # Window j+1 of length K-1 ends at row j of x.
    windows = padded.unfold(0, width, 1)[1:] if width > 0 else padded[1:, :, :0]
    return windows.to(x.dtype).contiguous()


def _check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or q.shape != k.shape or g.shape != k.shape:
        raise ValueError(
            f"q, k, g must share shape [T, h, Dk]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(g.shape)}"
        )
    tokens, heads, key_dim = k.shape
    if v.dim() != 3 or v.shape[:2] != (tokens, heads):
        raise ValueError(f"v must be [{tokens}, {heads}, Dv], got {tuple(v.shape)}")
    if tuple(beta.shape) != (tokens, heads):
        raise ValueError(f"beta must be [{tokens}, {heads}], got {tuple(beta.shape)}")
    expected_state = (heads, v.shape[2], key_dim)
    if state is not None and tuple(state.shape) != expected_state:
        raise ValueError(
            f"state must be value-first {list(expected_state)}, "
            f"got {tuple(state.shape)}"
        )


def _initial_state(
    state: torch.Tensor | None, v: torch.Tensor, key_dim: int
) -> torch.Tensor:
    """A private fp32 copy of the start state ([h, Dv, Dk]); zeros when None."""
    if state is None:
        _, heads, value_dim = v.shape
        return torch.zeros(
            heads, value_dim, key_dim, dtype=torch.float32, device=v.device
        )
    return state.float().clone()


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    scale: float | None = None,
    return_all_states: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Token-by-token KDA: the reference every other form is checked against.

    q, k [T, h, Dk] (already L2-normalised), v [T, h, Dv], g [T, h, Dk] log-decay
    (<= 0), beta [T, h], state [h, Dv, Dk] or None. Returns (o [T, h, Dv] fp32,
    final state) plus, with return_all_states, the state after every row [T, h, Dv, Dk].
    """
    _check_kda_inputs(q, k, v, g, beta, state)
    key_dim = k.shape[2]
    scale = key_dim**-0.5 if scale is None else scale
    q, k, v = q.float() * scale, k.float(), v.float()
    decay, beta = torch.exp(g.float()), beta.float()
    current = _initial_state(state, v, key_dim)
    outputs, snapshots = [], []
    for t in range(k.shape[0]):
        current = current * decay[t].unsqueeze(1)
        predicted = torch.einsum("hvk,hk->hv", current, k[t])
        update = beta[t].unsqueeze(1) * (v[t] - predicted)
        current = current + update.unsqueeze(2) * k[t].unsqueeze(1)
        outputs.append(torch.einsum("hvk,hk->hv", current, q[t]))
        if return_all_states:
            snapshots.append(current)
    o = torch.stack(outputs) if outputs else v.new_zeros(v.shape)
    if not return_all_states:
        return o, current
    if not snapshots:
        return o, current, current.new_zeros(0, *current.shape)
    return o, current, torch.stack(snapshots)


def _decayed_scores(
    rows: torch.Tensor, cols: torch.Tensor, cum_g: torch.Tensor
) -> torch.Tensor:
    """M[h, t, i] = sum_d rows[h,t,d] cols[h,i,d] exp(G[h,t,d] - G[h,i,d]) for i <= t.

    Entries above the diagonal are zero. Every exponent used is <= 0 because G (the
    within-chunk cumulative log-decay, fp64) is non-increasing: off-diagonal blocks
    factor through a reference row r between i and t, exp(G_t - G_r) * exp(G_r - G_i).
    """
    heads, length, _ = rows.shape
    scores = rows.new_zeros(heads, length, length)
    for start in range(0, length, _SUB_BLOCK):
        block = slice(start, min(start + _SUB_BLOCK, length))
        size = block.stop - start
        diff = cum_g[:, block, None, :] - cum_g[:, None, block, :]
        causal = torch.ones(size, size, dtype=torch.bool, device=rows.device).tril()
        decay = _decay(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
        scores[:, block, block] = torch.einsum(
            "htd,hid,htid->hti", rows[:, block], cols[:, block], decay
        )
        if start > 0:
            reference = cum_g[:, start - 1 : start]
            rows_decayed = rows[:, block] * _decay(cum_g[:, block] - reference)
            cols_decayed = cols[:, :start] * _decay(reference - cum_g[:, :start])
            scores[:, block, :start] = rows_decayed @ cols_decayed.transpose(1, 2)
    return scores


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA with the same contract and result as `recurrent_kda`.

    Per chunk with start state S0 and cumulative log-decay G_t (per key channel), the
    delta-rule pseudo-values solve the unit-lower-triangular system
        (I + diag(beta) A) U = diag(beta) (V - (K * exp G) S0^T),
    A[t, i] = sum_d k_t k_i exp(G_t - G_i) for i < t. Then
        O   = (Q * exp G) S0^T + P U,   P[t, i] = sum_d q_t k_i exp(G_t - G_i), i <= t,
        S1  = S0 diag(exp G_last) + U^T (K * exp(G_last - G)).
    """
    _check_kda_inputs(q, k, v, g, beta, state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    tokens, _, key_dim = k.shape
    scale = key_dim**-0.5 if scale is None else scale
    current = _initial_state(state, v, key_dim)
    # Head-major so every chunk step is a batched matmul over heads.
    q = (q.float() * scale).transpose(0, 1)
    k, v, g = (t.float().transpose(0, 1) for t in (k, v, g))
    beta = beta.float().t()
    outputs = []
    for start in range(0, tokens, chunk_size):
        span = slice(start, min(start + chunk_size, tokens))
        qc, kc, vc, bc = q[:, span], k[:, span], v[:, span], beta[:, span]
        cum_g = g[:, span].double().cumsum(dim=1)
        decay_from_start = _decay(cum_g)
        key_scores = _decayed_scores(kc, kc, cum_g).tril(diagonal=-1)
        system = bc.unsqueeze(2) * key_scores
        system.diagonal(dim1=1, dim2=2).add_(1.0)
        rhs = bc.unsqueeze(2) * (vc - (kc * decay_from_start) @ current.transpose(1, 2))
        pseudo_values = torch.linalg.solve_triangular(
            system, rhs, upper=False, unitriangular=True
        )
        query_scores = _decayed_scores(qc, kc, cum_g)
        outputs.append(
            (qc * decay_from_start) @ current.transpose(1, 2)
            + query_scores @ pseudo_values
        )
        last = cum_g[:, -1:]
        keys_to_end = kc * _decay(last - cum_g)
        current = current * _decay(last) + pseudo_values.transpose(1, 2) @ keys_to_end
    if not outputs:
        return v.transpose(0, 1).clone(), current
    return torch.cat(outputs, dim=1).transpose(0, 1).contiguous(), current


def kda_output_norm_gate(
    o: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor, eps: float
) -> torch.Tensor:
    """`RMSNorm_{o_norm}(o_h) * sigmoid(z_h)` per head, flattened to [T, h*Dv] fp32."""
    if o.dim() != 3:
        raise ValueError(f"o must be [T, heads, Dv], got {tuple(o.shape)}")
    tokens, heads, value_dim = o.shape
    if gate.numel() != o.numel() or gate.shape[0] != tokens:
        raise ValueError(
            f"gate must be [{tokens}, {heads * value_dim}] or [{tokens}, {heads}, "
            f"{value_dim}], got {tuple(gate.shape)}"
        )
    if norm_weight.numel() != value_dim:
        raise ValueError(f"norm_weight must have {value_dim} entries")
    o = o.float()
    normed = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = normed * norm_weight.float().view(value_dim)
    gated = normed * torch.sigmoid(gate.float().reshape(tokens, heads, value_dim))
    return gated.reshape(tokens, heads * value_dim)
