"""What every DSpark-style draft shares: the target's embedding and LM head, and the
Markov head.

A DSpark draft was trained against the frozen target table and has no LM head of its
own, so after its weights load it binds the target's `embed_tokens` and `lm_head` by
object reference (docs/pp_dspark.md, "Binding"). The bound modules stay *outside* the
draft's module tree: `draft.parameters()`, `state_dict()` and the loader's accounting
see only the draft's own weights, the memory ledger does not count the table twice,
and `.to()` on the target moves the shared modules in place (the draft keeps pointing
at the same module objects). The target owns them; the draft never moves or loads them.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.linear import ReplicatedLinear
from atom.models.utils import PPMissingLayer


def target_vocab_size(target_base: nn.Module) -> int:
    """The target's vocabulary, read without touching its embedding module.

    `target_base` is the language model (`.model`, `.lm_head`). `model.vocab_size` is
    set on every stage; the LM head is the fallback. `embed_tokens.num_embeddings` is
    never read: on a stage whose embedding is a PPMissingLayer that raises
    AttributeError and hides the placement error the caller is about to report.
    """
    vocab = getattr(getattr(target_base, "model", None), "vocab_size", None)
    if vocab is None:
        lm_head = getattr(target_base, "lm_head", None)
        if lm_head is not None and not isinstance(lm_head, PPMissingLayer):
            vocab = getattr(lm_head, "num_embeddings", None)
    if vocab is None:
        raise ValueError(
            f"cannot read the target vocabulary from {type(target_base).__name__}: "
            "it has neither model.vocab_size nor a real lm_head"
        )
    return int(vocab)


class SharedEmbeddingDraft(nn.Module):
    """Base of drafts that embed with the target's table and score with its LM head.

    Subclasses set `self.vocab_size`. `embed_tokens` and `lm_head` are None until
    `share_with_target`; a context-only producer never binds them.
    """

    # The attribute `check_shared_embedding` inspects after binding.
    shared_embedding_attr = "embed_tokens"

    def __init__(self) -> None:
        super().__init__()
        self.vocab_size = 0
        self._bind_shared("embed_tokens", None)
        self._bind_shared("lm_head", None)

    def _bind_shared(self, name: str, module: nn.Module | None) -> None:
        # object.__setattr__ skips nn.Module's registration: the module stays the
        # target's, so it is neither a draft parameter nor moved by `draft.to()`.
        object.__setattr__(self, name, module)

    def validate_target_vocab(self, target_base: nn.Module) -> int:
        """Raise ValueError unless the target's vocabulary equals the draft's."""
        vocab = target_vocab_size(target_base)
        if vocab != self.vocab_size:
            raise ValueError(
                f"draft vocab_size {self.vocab_size} differs from the target's "
                f"vocab_size {vocab}; the draft must score the target's vocabulary"
            )
        return vocab

    def share_with_target(self, target_base: nn.Module) -> None:
        """Bind the target's `model.embed_tokens` and `lm_head` (the same objects).

        Validates the vocabulary first. Placement (a PPMissingLayer where the table
        should be) is `check_shared_embedding`'s job, so binding one succeeds here.
        """
        self.validate_target_vocab(target_base)
        self._bind_shared("embed_tokens", target_base.model.embed_tokens)
        self._bind_shared("lm_head", target_base.lm_head)

    def shared_parameter_bytes(self) -> int:
        """Bytes of the bound target modules (owned and counted by the target)."""
        total = 0
        for module in (self.embed_tokens, self.lm_head):
            if module is not None:
                total += sum(p.numel() * p.element_size() for p in module.parameters())
        return total


class MarkovHead(nn.Module):
    """Low-rank first-order transition bias: bias(prev) = W1[prev] @ W2^T (fp32)."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        # Both tables are [V, r]; replicated, since a sharded W2 would need a gather
        # per drafted position.
        self.markov_w1 = ReplicatedLinear(rank, vocab_size)
        self.markov_w2 = ReplicatedLinear(rank, vocab_size)

    def bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """[B] previous tokens -> [B, V] fp32 logit bias."""
        w1 = self.markov_w1.weight[prev_ids].float()
        return w1 @ self.markov_w2.weight.float().t()
