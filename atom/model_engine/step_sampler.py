"""Last-stage token choice for one batch: plain sampling or draft verification.

Every TP rank of the last stage runs this on identical logits with identically seeded
per-request generators, so all ranks pick the same tokens without a broadcast.
"""

from __future__ import annotations

import torch

from atom.model_engine.batch import SeqWork
from atom.model_ops.rejection_sampler import rejection_sample
from atom.model_ops.sampler import Sampler, probs_for


class StepSampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}
        # Draft distributions q of the drafts each sequence will verify next step.
        self.draft_probs: dict[int, torch.Tensor] = {}

    def generator(self, work: SeqWork) -> torch.Generator:
        gen = self.generators.get(work.seq_id)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(work.seed if work.seed is not None else work.seq_id)
            self.generators[work.seq_id] = gen
        return gen

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
            self.draft_probs.pop(seq_id, None)

    @staticmethod
    def rows_to_score(seqs: list[SeqWork], query_start_loc: list[int]) -> list[int]:
        """Flat row indices whose logits are needed: the last row, or all verify rows."""
        rows: list[int] = []
        for i, work in enumerate(seqs):
            if not work.sample:
                continue
            end = query_start_loc[i + 1]
            rows.extend(range(end - 1 - work.num_spec_tokens, end))
        return rows

    def choose(
        self, seqs: list[SeqWork], logits: torch.Tensor
    ) -> tuple[list[int], list[list[int]], list[int]]:
        """(seq ids, emitted tokens per seq, accepted drafts per seq)."""
        seq_ids, emitted, accepted = [], [], []
        offset = 0
        for work in seqs:
            if not work.sample:
                continue
            rows = logits[offset : offset + work.num_spec_tokens + 1].float().cpu()
            offset += work.num_spec_tokens + 1
            if work.num_spec_tokens:
                tokens, num_accepted = self._verify(work, rows)
            else:
                tokens, num_accepted = [self._sample_one(work, rows)], 0
            seq_ids.append(work.seq_id)
            emitted.append(tokens)
            accepted.append(num_accepted)
        return seq_ids, emitted, accepted

    def _sample_one(self, work: SeqWork, row: torch.Tensor) -> int:
        token = self.sampler.sample(
            row,
            [work.temperature],
            [work.top_k],
            [work.top_p],
            [self.generator(work)],
        )
        return int(token[0])

    def _verify(self, work: SeqWork, rows: torch.Tensor) -> tuple[list[int], int]:
        drafts = torch.tensor(work.token_ids[1:], dtype=torch.long)
        greedy = work.temperature == 0
        if greedy:
            target = rows
            draft_probs = None
        else:
            target = probs_for(rows, work.temperature, work.top_k, work.top_p)
            stored = self.draft_probs.get(work.seq_id)
            draft_probs = None if stored is None else stored[: len(drafts)]
        return rejection_sample(
            target, drafts, draft_probs, greedy, self.generator(work)
        )
