"""Golden reference for Kimi Linear, Kimi-K3 and K3.1 (docs/kimi_k3.md).

Slow and plain on purpose: one sequence, full recompute, fp32, no caches, no chunking,
no parallelism, and the KDA recurrence as a token loop. It imports nothing from atom,
so it is an independent oracle for atom's layers, caches and parallel schedules.

    golden = GoldenModel.from_pretrained(path)
    logits, hidden_states = golden(ids)      # [T, V] fp32; list of [T, H]
    new_tokens = golden.golden_greedy(ids, n)

`hidden_states[0]` is the embedding output and `hidden_states[k + 1]` the output of
layer k: the within-block prefix sum `p_out(k)` with AttnRes, else the residual stream.
These are exactly the DSpark taps (docs/dspark.md).
"""

import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

Tensor = torch.Tensor
_DENSE_SAVED_AS_MOE = re.compile(
    r"(layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.)"
)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def load_tensors(path: Path) -> dict[str, Tensor]:
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    tensors = {}
    for file_name in files:
        tensors.update(load_file(str(path / file_name)))
    return {name: t.float() for name, t in tensors.items()}


def _canonical_name(name: str) -> str:
    # vLLM spells `language_model.layers.`; transformers' save_pretrained also renames
    # a dense layer's `mlp.{gate,up,down}_proj` to `block_sparse_moe.*`.
    name = name.replace("language_model.layers.", "language_model.model.layers.")
    return _DENSE_SAVED_AS_MOE.sub(r"\1mlp.\2", name)


class GoldenModel:
    def __init__(
        self,
        config: dict,
        tensors: dict[str, Tensor],
        mla_norm_eps: float | None = None,
    ):
        wrapped = isinstance(config.get("text_config"), dict)
        self.cfg = cfg = config["text_config"] if wrapped else config
        self.prefix = "language_model." if wrapped else ""
        self.tensors = {
            _canonical_name(name): t
            for name, t in tensors.items()
            if name.startswith(self.prefix)
        }
        self.eps = cfg["rms_norm_eps"]
        self.mla_eps = self.eps if mla_norm_eps is None else mla_norm_eps
        self.num_layers = cfg["num_hidden_layers"]
        self.block_size = cfg.get("attn_res_block_size")
        lac = cfg["linear_attn_config"]
        kda = [i - 1 for i in lac["kda_layers"]]
        full = [i - 1 for i in lac["full_attn_layers"]]
        if sorted(kda + full) != list(range(self.num_layers)):
            raise ValueError(
                "kda_layers and full_attn_layers must partition the layers"
            )
        self.kda_layers = set(kda)
        if not cfg.get("mla_use_nope", True):
            raise ValueError("the golden target MLA is NoPE only (mla_use_nope: false)")
        if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError("only sigmoid routing is supported")

    @classmethod
    def from_pretrained(
        cls, path: str | Path, mla_norm_eps: float | None = None
    ) -> "GoldenModel":
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        return cls(config, load_tensors(path), mla_norm_eps)

    def w(self, name: str) -> Tensor:
        return self.tensors[self.prefix + name]

    def linear(self, name: str, x: Tensor) -> Tensor:
        return x @ self.w(name + ".weight").T

    def norm(self, name: str, x: Tensor, eps: float | None = None) -> Tensor:
        return rms_norm(x, self.w(name + ".weight"), self.eps if eps is None else eps)

    # ---- model ----------------------------------------------------------------

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> tuple[Tensor, list[Tensor]]:
        vocab = self.cfg["vocab_size"]
        if not ids or any(not 0 <= i < vocab for i in ids):
            raise ValueError(f"ids must be a non-empty list of ids in [0, {vocab})")
        h = self.w("model.embed_tokens.weight")[torch.tensor(ids)]
        hidden_states = [h]
        if self.block_size is None:
            final = self._residual_stack(h, hidden_states)
        else:
            final = self._attn_res_stack(h, hidden_states)
        return self.linear("lm_head", self.norm("model.norm", final)), hidden_states

    def golden_greedy(self, ids: list[int], n: int) -> list[int]:
        """The next `n` argmax tokens (no stop on eos), recomputing from scratch."""
        seq = list(ids)
        for _ in range(n):
            logits, _ = self(seq)
            seq.append(int(logits[-1].argmax()))
        return seq[len(ids) :]

    def _residual_stack(self, h: Tensor, hidden_states: list[Tensor]) -> Tensor:
        for layer in range(self.num_layers):
            lp = f"model.layers.{layer}."
            h = h + self._attention(layer, self.norm(lp + "input_layernorm", h))
            h = h + self._ffn(layer, self.norm(lp + "post_attention_layernorm", h))
            hidden_states.append(h)
        return h

    def _attn_res_stack(self, e: Tensor, hidden_states: list[Tensor]) -> Tensor:
        """Spec 4.1: a bank of closed blocks plus the open block's partial sum."""
        bank: list[Tensor] = []
        partial: Tensor | None = e
        ffn_out = None
        for layer in range(self.num_layers):
            lp = f"model.layers.{layer}."
            if ffn_out is not None:
                partial = partial + ffn_out
            mixed = self._mix(lp + "self_attention_res", bank, partial)
            x = self.norm(lp + "input_layernorm", mixed)
            if layer % self.block_size == 0:
                bank.append(partial)
                partial = None
            attn_out = self._attention(layer, x)
            partial = attn_out if partial is None else partial + attn_out
            mixed = self._mix(lp + "mlp_res", bank, partial)
            ffn_out = self._ffn(
                layer, self.norm(lp + "post_attention_layernorm", mixed)
            )
            hidden_states.append(partial + ffn_out)
        return self._mix("model.output_attn_res", bank, partial + ffn_out)

    def _mix(self, site: str, bank: list[Tensor], partial: Tensor) -> Tensor:
        """Softmax over candidates of w_p . RMSNorm_{w_n}(c), mixing the raw c."""
        candidates = torch.stack([*bank, partial])  # [n, T, H]
        scores = self.linear(site + "_proj", self.norm(site + "_norm", candidates))
        alpha = scores.softmax(dim=0)  # [n, T, 1]
        return (alpha * candidates).sum(0)

    def _attention(self, layer: int, x: Tensor) -> Tensor:
        if layer in self.kda_layers:
            return self._kda(f"model.layers.{layer}.self_attn.", x)
        return self._mla(f"model.layers.{layer}.self_attn.", x)

    # ---- KDA ------------------------------------------------------------------

    def _kda(self, p: str, x: Tensor) -> Tensor:
        lac = self.cfg["linear_attn_config"]
        heads, dim = lac["num_heads"], lac["head_dim"]
        per_head = (x.shape[0], heads, dim)
        q, k, v = (
            _causal_conv_silu(
                self.linear(f"{p}{n}_proj", x), self.w(f"{p}{n}_conv1d.weight")
            ).view(per_head)
            for n in "qkv"
        )
        f = self.linear(p + "f_b_proj", self.linear(p + "f_a_proj", x))
        f = (f + self.w(p + "dt_bias")).view(per_head)
        decay_rate = self.w(p + "A_log").flatten()[:heads].exp()[None, :, None]
        lower_bound = lac.get("gate_lower_bound")
        if lower_bound is None:
            softplus = torch.where(f > 20.0, f, torch.log1p(torch.exp(f)))
            log_decay = -decay_rate * softplus
        else:
            log_decay = lower_bound * torch.sigmoid(decay_rate * f)
        beta = torch.sigmoid(self.linear(p + "b_proj", x))  # [T, heads]
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dim)
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)

        state = torch.zeros(heads, dim, dim)  # [heads, Dv, Dk]
        outputs = []
        for t in range(x.shape[0]):
            state = state * log_decay[t].exp()[:, None, :]
            read = torch.einsum("hvk,hk->hv", state, k[t])
            update = beta[t][:, None] * (v[t] - read)
            state = state + update[:, :, None] * k[t][:, None, :]
            outputs.append(torch.einsum("hvk,hk->hv", state, q[t]))
        o = self.norm(p + "o_norm", torch.stack(outputs))

        if lac.get("use_full_rank_gate", False):
            gate = self.linear(p + "g_proj", x)
        else:
            gate = self.linear(p + "g_b_proj", self.linear(p + "g_a_proj", x))
        y = o * torch.sigmoid(gate.view(per_head))
        return self.linear(p + "o_proj", y.flatten(1))

    # ---- MLA ------------------------------------------------------------------

    def _mla(self, p: str, x: Tensor) -> Tensor:
        cfg = self.cfg
        heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
        rope, v_dim = cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        kv_lora, seq_len = cfg["kv_lora_rank"], x.shape[0]
        if cfg.get("q_lora_rank"):
            c_q = self.norm(
                p + "q_a_layernorm", self.linear(p + "q_a_proj", x), self.mla_eps
            )
            q = self.linear(p + "q_b_proj", c_q)
        else:
            q = self.linear(p + "q_proj", x)
        q = q.view(seq_len, heads, nope + rope)
        latent = self.linear(p + "kv_a_proj_with_mqa", x)
        c_kv = self.norm(p + "kv_a_layernorm", latent[:, :kv_lora], self.mla_eps)
        k_pe = latent[:, None, kv_lora:].expand(seq_len, heads, rope)  # NoPE, shared
        kv = self.linear(p + "kv_b_proj", c_kv).view(seq_len, heads, nope + v_dim)
        k = torch.cat([kv[..., :nope], k_pe], dim=-1)
        v = kv[..., nope:]
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(nope + rope)
        future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        o = torch.einsum("hts,shd->thd", probs, v).reshape(seq_len, heads * v_dim)
        if cfg.get("mla_use_output_gate", False):
            o = o * torch.sigmoid(self.linear(p + "g_proj", x))
        return self.linear(p + "o_proj", o)

    # ---- FFN ------------------------------------------------------------------

    def _act(self, gate: Tensor, up: Tensor) -> Tensor:
        act = self.cfg.get("hidden_act", "silu")
        if act == "silu":
            return F.silu(gate) * up
        if act == "situ":
            beta = self.cfg.get("activation_situ_beta") or 1.0
            linear_beta = self.cfg.get("activation_situ_linear_beta")
            if linear_beta:
                up = linear_beta * torch.tanh(up / linear_beta)
            return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up
        raise ValueError(f"unsupported hidden_act {act!r}")

    def _mlp(self, p: str, x: Tensor) -> Tensor:
        inner = self._act(
            self.linear(p + "gate_proj", x), self.linear(p + "up_proj", x)
        )
        return self.linear(p + "down_proj", inner)

    def _ffn(self, layer: int, x: Tensor) -> Tensor:
        lp = f"model.layers.{layer}."
        dense = layer < self.cfg.get("first_k_dense_replace", 0)
        if dense or layer % self.cfg.get("moe_layer_freq", 1):
            return self._mlp(lp + "mlp.", x)
        return self._moe(lp + "block_sparse_moe.", x)

    def _route(self, p: str, x: Tensor) -> tuple[Tensor, Tensor]:
        """noaux_tc: choose with the biased score, weight with the unbiased one."""
        cfg = self.cfg
        num_experts, top_k = cfg["num_experts"], cfg["num_experts_per_token"]
        scores = torch.sigmoid(self.linear(p + "gate", x))
        choice = scores + self.w(p + "gate.e_score_correction_bias")
        groups = cfg.get("num_expert_group", 1)
        if cfg.get("use_grouped_topk", True) and groups > 1:
            grouped = choice.view(-1, groups, num_experts // groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            kept = group_scores.topk(cfg["topk_group"], dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, kept, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf"))
            choice = choice.view(-1, num_experts)
        experts = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if cfg.get("moe_renormalize", True):
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * cfg.get("routed_scaling_factor", 1.0)

    def _moe(self, p: str, x: Tensor) -> Tensor:
        experts, weights = self._route(p, x)
        latent = self.cfg.get("routed_expert_hidden_size")
        xi = self.linear(p + "routed_expert_down_proj", x) if latent else x
        routed = torch.zeros_like(xi)
        for t in range(x.shape[0]):
            for e, weight in zip(experts[t].tolist(), weights[t]):
                ep = f"{p}experts.{e}."
                inner = self._act(
                    self.linear(ep + "w1", xi[t]), self.linear(ep + "w3", xi[t])
                )
                routed[t] += weight * self.linear(ep + "w2", inner)
        if latent:
            if self.cfg.get("latent_moe_use_norm", False):
                routed = self.norm(p + "routed_expert_norm", routed)
            routed = self.linear(p + "routed_expert_up_proj", routed)
        return routed + self._mlp(p + "shared_experts.", x)


def _causal_conv_silu(u: Tensor, weight: Tensor) -> Tensor:
    """Depthwise causal conv then SiLU: out[t] = sum_i w[:, i] * u[t - K + 1 + i]."""
    kernel = weight.shape[-1]
    out = torch.zeros_like(u)
    for i in range(kernel):
        shift = kernel - 1 - i
        out[shift:] += weight[:, 0, i] * u[: u.shape[0] - shift]
    return F.silu(out)
