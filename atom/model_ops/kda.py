"""Kimi Delta Attention (KDA) math for a batch of sequences, all heads at once.

Layouts: batch then tokens (`[B, T, h, D]`), recurrent state value-first
`[B, h, Dv, Dk]` in fp32. Sequences of different lengths are padded at the end with
rows whose gate g = 0 and write strength beta = 0, which leave the state untouched.
The token loop `recurrent_kda` is the correctness oracle; `chunk_kda` is the chunked
(WY / UT-transform) form used for prefill and must agree with it. The KDA equations
are written out in docs/kimi_k3.md.
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
    """Per-channel log-decay g of f's shape [..., h, D] in fp32.

    `f` is `W_fb(W_fa x)` viewed as [..., h, D]; `dt_bias` is added here in fp32.
    K3 (lower_bound set): `lb * sigmoid(exp(A_log) * (f + dt_bias))`, in (lb, 0).
    Kimi Linear: `-exp(A_log) * softplus(f + dt_bias)`, softplus linear above 20.
    `a_log` may be [n] or legacy [1, 1, n, 1] with n >= h; the first h entries are used
    (under TP the caller passes this rank's heads).
    """
    if f.dim() < 2:
        raise ValueError(f"f must be [..., heads, head_dim], got {tuple(f.shape)}")
    heads, head_dim = f.shape[-2], f.shape[-1]
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
    decay_rate = torch.exp(a_flat[:heads].float()).view(heads, 1)
    pre = f.float() + dt_bias.float().view(heads, head_dim)
    if lower_bound is None:
        return -decay_rate * F.softplus(pre, beta=1.0, threshold=20.0)
    if not lower_bound < 0:
        raise ValueError(f"gate lower_bound must be negative, got {lower_bound}")
    return lower_bound * torch.sigmoid(decay_rate * pre)


def _conv_padded_input(
    x: torch.Tensor, conv_state: torch.Tensor | None, kernel_size: int
) -> torch.Tensor:
    """[B, K-1+T, C] fp32: each sequence's cached inputs (or zeros) followed by x."""
    batch, _, channels = x.shape
    if conv_state is None:
        history = x.new_zeros(batch, kernel_size - 1, channels, dtype=torch.float32)
    else:
        if tuple(conv_state.shape) != (batch, channels, kernel_size - 1):
            raise ValueError(
                f"conv_state must be [{batch}, {channels}, {kernel_size - 1}], "
                f"got {tuple(conv_state.shape)}"
            )
        history = conv_state.float().transpose(1, 2)
    return torch.cat([history, x.float()], dim=1)


def _check_conv_inputs(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0, :]
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(
            f"expected x [B, T, C] and weight [C, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    return weight


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (no bias) + SiLU over x [B, T, C] with weight [C, K].

    Inputs before each sequence's first row come from conv_state [B, C, K-1] (zeros
    if None). Returns (y [B, T, C] in x.dtype, new_state [B, C, K-1]): the last K-1
    pre-conv inputs of each sequence, which ends at row `lengths[b]` (padded batches)
    or at row T. A checkpoint weight [C, 1, K] is accepted too.
    """
    weight = _check_conv_inputs(x, weight)
    channels, kernel_size = weight.shape
    padded = _conv_padded_input(x, conv_state, kernel_size)
    y = F.conv1d(padded.transpose(1, 2), weight.float().unsqueeze(1), groups=channels)
    y = F.silu(y.transpose(1, 2))
    width = kernel_size - 1
    if lengths is None:
        new_state = padded[:, padded.shape[1] - width :]
    else:
        # Padded row j of sequence b holds input j - width; its last `width` inputs
        # are padded rows lengths[b] .. lengths[b] + width - 1.
        rows = lengths.view(-1, 1) + torch.arange(width, device=x.device)
        new_state = padded.gather(1, rows.unsqueeze(-1).expand(-1, -1, channels))
    return y.to(x.dtype), new_state.transpose(1, 2).to(x.dtype).contiguous()


def conv_state_after_each_row(
    x: torch.Tensor, conv_state: torch.Tensor
) -> torch.Tensor:
    """[B, T, C, K-1]: the conv state after consuming rows 0..j of x [B, T, C].

    Speculative verify commits the state after the last accepted row.
    """
    if x.dim() != 3 or conv_state.dim() != 3:
        raise ValueError(
            f"expected x [B, T, C] and conv_state [B, C, K-1], got {tuple(x.shape)} "
            f"and {tuple(conv_state.shape)}"
        )
    width = conv_state.shape[2]
    padded = _conv_padded_input(x, conv_state, width + 1)
    # Window j+1 of length K-1 ends at row j of x.
    windows = padded.unfold(1, width, 1)[:, 1:] if width > 0 else padded[:, 1:, :, :0]
    return windows.to(x.dtype).contiguous()


def _check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> None:
    if q.dim() != 4 or q.shape != k.shape or g.shape != k.shape:
        raise ValueError(
            f"q, k, g must share shape [B, T, h, Dk]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(g.shape)}"
        )
    batch, tokens, heads, key_dim = k.shape
    if v.dim() != 4 or v.shape[:3] != (batch, tokens, heads):
        raise ValueError(
            f"v must be [{batch}, {tokens}, {heads}, Dv], got {tuple(v.shape)}"
        )
    if tuple(beta.shape) != (batch, tokens, heads):
        raise ValueError(
            f"beta must be [{batch}, {tokens}, {heads}], got {tuple(beta.shape)}"
        )
    expected_state = (batch, heads, v.shape[3], key_dim)
    if state is not None and tuple(state.shape) != expected_state:
        raise ValueError(
            f"state must be value-first {list(expected_state)}, "
            f"got {tuple(state.shape)}"
        )


def _initial_state(
    state: torch.Tensor | None, v: torch.Tensor, key_dim: int
) -> torch.Tensor:
    """A private fp32 copy of the start states ([B, h, Dv, Dk]); zeros when None."""
    if state is None:
        batch, _, heads, value_dim = v.shape
        return torch.zeros(
            batch, heads, value_dim, key_dim, dtype=torch.float32, device=v.device
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
    """Token-by-token KDA for a batch of sequences: the reference of every other form.

    q, k [B, T, h, Dk] (already L2-normalised), v [B, T, h, Dv], g [B, T, h, Dk]
    log-decay (<= 0), beta [B, T, h], state [B, h, Dv, Dk] or None. A padded row with
    g = 0 and beta = 0 leaves the state unchanged. Returns (o [B, T, h, Dv] fp32,
    final state) plus, with return_all_states, the state after every row
    [B, T, h, Dv, Dk].
    """
    _check_kda_inputs(q, k, v, g, beta, state)
    key_dim = k.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    q, k, v = q.float() * scale, k.float(), v.float()
    decay, beta = torch.exp(g.float()), beta.float()
    current = _initial_state(state, v, key_dim)
    outputs, snapshots = [], []
    for t in range(k.shape[1]):
        current = current * decay[:, t].unsqueeze(2)
        k_t = k[:, t]
        predicted = torch.einsum("bhvk,bhk->bhv", current, k_t)
        update = beta[:, t].unsqueeze(2) * (v[:, t] - predicted)
        current = current + update.unsqueeze(3) * k_t.unsqueeze(2)
        outputs.append(torch.einsum("bhvk,bhk->bhv", current, q[:, t]))
        if return_all_states:
            snapshots.append(current)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    if not return_all_states:
        return o, current
    if not snapshots:
        return o, current, current.new_zeros(current.shape[0], 0, *current.shape[1:])
    return o, current, torch.stack(snapshots, dim=1)


def _decayed_scores(
    rows: torch.Tensor, cols: torch.Tensor, cum_g: torch.Tensor
) -> torch.Tensor:
    """M[n, t, i] = sum_d rows[n,t,d] cols[n,i,d] exp(G[n,t,d] - G[n,i,d]), i <= t.

    n runs over (sequence, head) pairs. Entries above the diagonal are zero. Every
    exponent used is <= 0 because G (the within-chunk cumulative log-decay, fp64) is
    non-increasing: off-diagonal blocks factor through a reference row r between i
    and t, exp(G_t - G_r) * exp(G_r - G_i).
    """
    pairs, length, _ = rows.shape
    scores = rows.new_zeros(pairs, length, length)
    for start in range(0, length, _SUB_BLOCK):
        block = slice(start, min(start + _SUB_BLOCK, length))
        size = block.stop - start
        # Differences inside a sub-block are small: fp32 holds them exactly enough.
        diff = (cum_g[:, block, None, :] - cum_g[:, None, block, :]).float()
        causal = torch.ones(size, size, dtype=torch.bool, device=rows.device).tril()
        decay = _decay(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
        scores[:, block, block] = torch.einsum(
            "ntd,nid,ntid->nti", rows[:, block], cols[:, block], decay
        )
        if start > 0:
            reference = cum_g[:, start - 1 : start]
            rows_decayed = rows[:, block] * _decay(cum_g[:, block] - reference)
            cols_decayed = cols[:, :start] * _decay(reference - cum_g[:, :start])
            scores[:, block, :start] = rows_decayed @ cols_decayed.transpose(1, 2)
    return scores


def _pairs_first(x: torch.Tensor) -> torch.Tensor:
    """[B, T, h, *rest] -> [B*h, T, *rest]: one row of work per (sequence, head)."""
    batch, tokens, heads = x.shape[:3]
    moved = x.transpose(1, 2)
    return moved.reshape(batch * heads, tokens, *x.shape[3:])


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
    Padded rows (g = 0, beta = 0) give U = 0 and leave G unchanged, so a batch padded
    at the end yields each sequence's own final state.
    """
    _check_kda_inputs(q, k, v, g, beta, state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    batch, tokens, heads, key_dim = k.shape
    value_dim = v.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    current = _initial_state(state, v, key_dim).view(batch * heads, value_dim, key_dim)
    # Pair-major so every chunk step is a batched matmul over (sequence, head).
    q = _pairs_first(q.float() * scale)
    k, v, g = (_pairs_first(t.float()) for t in (k, v, g))
    beta = _pairs_first(beta.float().unsqueeze(-1)).squeeze(-1)
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
    final = current.view(batch, heads, value_dim, key_dim)
    if not outputs:
        return v.new_zeros(batch, 0, heads, value_dim), final
    o = torch.cat(outputs, dim=1).view(batch, heads, tokens, value_dim)
    return o.transpose(1, 2).contiguous(), final


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
