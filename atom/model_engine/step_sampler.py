"""One step's token choice on the last stage: sample or verify, then draft.

`StepSampler.launch` takes the scored logits and the step's `SamplingMetadata` and
does, on the device and for all sampled sequences at once: plain sampling or draft
verification, the drafter's next proposal, and storing the draft distributions
that temperature > 0 requests verify next. Later (async scheduling launches the
next step first), `SampledStep.choices` brings back every sequence's tokens,
accepted count and drafts in one device-to-host copy.

Every TP rank of the last stage runs this on identical logits; the counter-based
uniforms depend only on (seed, position, stream), so all ranks pick the same
tokens without a broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atom.model_engine.batch import SeqWork, TokenChoice
from atom.model_ops.host_copy import HostFetch, host_to_device
from atom.model_ops.logprobs import prompt_token_logprobs
from atom.model_ops.rejection_sampler import verify_drafts
from atom.model_ops.sampler import sample_tokens
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.model_ops.token_logprob import TokenLogprob
from atom.spec_decode.draft_output import DraftOutput

if TYPE_CHECKING:
    from atom.spec_decode.drafter import Drafter


class StepSampler:
    """Chooses each step's tokens and owns the draft distributions between steps."""

    def __init__(
        self, drafter: Drafter | None = None, greedy_verify_kernel: bool = False
    ) -> None:
        # None without speculation and on a context-only producer.
        self.drafter = drafter
        # Verify greedy steps in one launch (atom/kernels/greedy_verify.py): on a
        # GPU, where each of the torch path's dozen operators costs a launch.
        self.greedy_verify_kernel = greedy_verify_kernel
        # q [T, V] (device) of the drafts each temperature > 0 sequence verifies
        # next; greedy requests need none.
        self.draft_probs: dict[int, torch.Tensor] = {}
        # Prompt logprobs of the chunks prefilled so far, per sequence that wants
        # them, until the step that samples its first output takes them.
        self.prompt_logprobs: dict[int, list[TokenLogprob]] = {}

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.draft_probs.pop(seq_id, None)
            self.prompt_logprobs.pop(seq_id, None)

    def record_prompt_logprobs(
        self,
        works: list[SeqWork],
        hidden: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Score the prompt rows of the works that want prompt logprobs.

        hidden: [N, H] the forward's rows, works' rows in batch order. A chunk at
        position 0 starts the sequence's list afresh (a preempted sequence
        prefills again from the start: prefix reuse is off for it).
        """
        wanted, start = [], 0
        for work in works:
            if work.prompt_logprobs is not None:
                wanted.append((work, start))
                if work.context_len == 0:
                    self.prompt_logprobs[work.seq_id] = []
            start += work.num_rows
        scored = [(w, first) for w, first in wanted if w.prompt_logprob_targets]
        if not scored:
            return
        rows = [
            first + i
            for w, first in scored
            for i in range(len(w.prompt_logprob_targets))
        ]
        targets = [t for w, _ in scored for t in w.prompt_logprob_targets]
        device = hidden.device
        logprobs = prompt_token_logprobs(
            hidden[host_to_device(rows, torch.long, device)],
            host_to_device(targets, torch.long, device),
            max(w.prompt_logprobs for w, _ in scored),
            compute_logits,
        )
        offset = 0
        for work, _ in scored:
            count = len(work.prompt_logprob_targets)
            kept = self.prompt_logprobs.setdefault(work.seq_id, [])
            kept.extend(
                TokenLogprob(lp.token_id, lp.logprob, lp.top[: work.prompt_logprobs])
                for lp in logprobs[offset : offset + count]
            )
            offset += count

    def attach_prompt_logprobs(
        self, works: list[SeqWork], choices: list[TokenChoice]
    ) -> None:
        """Hand each sampled sequence's finished prompt logprobs to its choice."""
        sampled = [work for work in works if work.sample]
        for work, choice in zip(sampled, choices):
            if work.prompt_logprobs is not None:
                choice.prompt_logprobs = self.prompt_logprobs.pop(work.seq_id, [])

    def launch(self, logits: torch.Tensor, sampling: SamplingMetadata) -> SampledStep:
        """The step's choices, on the device; `SampledStep.choices` brings them to
        the host (one TokenChoice per sampled sequence, in batch order).

        logits: [R, V], the rows `sampling.logit_rows` selected, in that order.
        """
        spec = sampling.spec
        if spec is None:
            raise ValueError("the step's SamplingMetadata carries no spec metadata")
        if self._verifies_in_one_launch(sampling):
            return self._launch_greedy_verify(logits, sampling)
        # [S, W, V]: row j of sequence s predicts the token after its draft j.
        scored = logits.unsqueeze(1) if spec.max_drafts == 0 else logits[spec.row_index]
        if sampling.adjust is not None:
            # One adjustment for sampling and verification, each verify row
            # counting the drafts before it: lossless speculation with penalties.
            scored = sampling.adjust.apply(scored, spec.draft_ids, spec.num_drafts)
        if spec.max_drafts == 0:
            emitted = sample_tokens(scored[:, 0], sampling).unsqueeze(1)
            accepted = torch.zeros_like(emitted[:, 0])
        else:
            emitted, accepted = verify_drafts(
                scored,
                spec.draft_ids,
                spec.num_drafts,
                self._probs_of_verified_drafts(sampling, logits),
                sampling,
            )
        logprobs = None
        if sampling.logprobs is not None:
            logprobs = sampling.logprobs.compute(scored, emitted)
        drafts = None
        if self.drafter is not None:
            # The last emitted token anchors the next block; it sits accepted
            # positions after the sequence's first decided position.
            anchors = emitted.gather(1, accepted.unsqueeze(1)).squeeze(1)
            drafts = self.drafter.propose(
                anchors, sampling.positions + accepted, spec.block_tables, sampling
            )
            self.store_draft_probs(sampling, drafts)
        parts = [accepted.unsqueeze(1), emitted]
        if drafts is not None:
            parts += [anchors.unsqueeze(1), drafts.ids]
        packed = torch.cat(parts, dim=1)
        # What the next step's pending rows take (pending_tokens.py): the anchor
        # and the drafts after it, or the one sampled token.
        next_inputs = emitted if drafts is None else packed[:, 1 + emitted.shape[1] :]
        fetched = [packed]
        if logprobs is not None:
            chosen, top_values, top_ids = logprobs
            fetched += [torch.cat([chosen.unsqueeze(2), top_values], dim=2), top_ids]
        # The step's one device-to-host copy (two more only for logprobs), started
        # now and read by SampledStep.choices.
        return SampledStep(sampling, emitted, next_inputs, accepted, HostFetch(fetched))

    def _verifies_in_one_launch(self, sampling: SamplingMetadata) -> bool:
        """Whether this step takes the greedy verify kernel: every row greedy, with
        drafts to verify and next, and nothing that needs the scored logits."""
        return (
            self.greedy_verify_kernel
            and self.drafter is not None
            and sampling.spec.max_drafts > 0
            and sampling.all_greedy
            and sampling.adjust is None
            and sampling.logprobs is None
        )

    def _launch_greedy_verify(
        self, logits: torch.Tensor, sampling: SamplingMetadata
    ) -> SampledStep:
        """`launch` for an all-greedy verify step: the argmax of every scored row,
        one kernel for the acceptance, the emitted rows and the anchors, written
        straight into the packed fetch, then the drafts after them."""
        from atom.kernels.greedy_verify import greedy_verify

        spec = sampling.spec
        num_seqs, width = spec.draft_ids.shape[0], spec.max_drafts + 1
        num_next = self.drafter.num_speculative_tokens
        packed = torch.empty(
            num_seqs, 2 + width + num_next, dtype=torch.long, device=logits.device
        )
        anchor_positions = greedy_verify(
            logits.argmax(dim=-1),
            spec.row_index,
            spec.draft_ids,
            spec.num_drafts,
            sampling.positions,
            packed,
        )
        drafts = self.drafter.propose(
            packed[:, 1 + width], anchor_positions, spec.block_tables, sampling
        )
        packed[:, 2 + width :].copy_(drafts.ids)
        return SampledStep(
            sampling,
            packed[:, 1 : 1 + width],
            packed[:, 1 + width :],
            packed[:, 0],
            HostFetch([packed]),
        )

    def store_draft_probs(
        self, sampling: SamplingMetadata, drafts: DraftOutput
    ) -> None:
        """Keep, on the device, q of the drafts temperature > 0 requests verify next."""
        if drafts.probs is None or sampling.all_greedy:
            return
        kept = drafts.probs.index_select(0, sampling.sampled_index)
        sampled_ids = [
            seq_id
            for seq_id, greedy in zip(sampling.seq_ids, sampling.greedy_host)
            if not greedy
        ]
        for seq_id, probs in zip(sampled_ids, kept):
            self.draft_probs[seq_id] = probs

    def _probs_of_verified_drafts(
        self, sampling: SamplingMetadata, logits: torch.Tensor
    ) -> torch.Tensor | None:
        """[S, T, V] q of the drafts verified now; zeros where unused (greedy
        requests, sequences without drafts); None when every request is greedy."""
        if sampling.all_greedy:
            return None
        spec = sampling.spec
        width = spec.max_drafts
        unused = logits.new_zeros(width, logits.shape[-1], dtype=torch.float32)
        rows = []
        for seq_id, greedy, count in zip(
            sampling.seq_ids, sampling.greedy_host, spec.num_drafts_host
        ):
            if greedy or count == 0:
                rows.append(unused)
                continue
            stored = self.draft_probs.get(seq_id)
            if stored is None or stored.shape[0] < count:
                raise RuntimeError(
                    f"sequence {seq_id} verifies {count} sampled drafts but their "
                    "draft distributions were never stored"
                )
            rows.append(stored[:width])
        return torch.stack(rows)


@dataclass
class SampledStep:
    """One step's choices while they are still on the device."""

    sampling: SamplingMetadata
    # [S, W] emitted tokens (W = 1 without drafts).
    emitted: torch.Tensor
    # [S, 1 + T] the next step's inputs: the anchor and the T next drafts (the
    # emitted token without a drafter); [S] the accepted drafts.
    next_inputs: torch.Tensor
    accepted: torch.Tensor
    # [S, 1 + W (+ 1 + T)] rows of (accepted count, emitted, and with a drafter the
    # anchor and the next drafts); then, with logprobs, [P, W, 1 + top] values
    # (the chosen token's first) and ids.
    fetch: HostFetch

    def choices(self) -> list[TokenChoice]:
        """One TokenChoice per sampled sequence, in batch order: the step's sync."""
        fetched = [t.tolist() for t in self.fetch.get()]
        sampling, width = self.sampling, self.emitted.shape[1]
        choices = [
            TokenChoice(seq_id, row[1 : 2 + row[0]], row[0], row[2 + width :])
            for seq_id, row in zip(sampling.seq_ids, fetched[0])
        ]
        if len(fetched) > 1:
            values, ids = fetched[1], fetched[2]
            wanted = sampling.logprobs
            for p, (row, num_top) in enumerate(
                zip(wanted.rows_host, wanted.num_top_host)
            ):
                choice = choices[row]
                choice.logprobs = [
                    TokenLogprob(
                        token,
                        values[p][j][0],
                        list(zip(ids[p][j][:num_top], values[p][j][1 : 1 + num_top])),
                    )
                    for j, token in enumerate(choice.token_ids)
                ]
        return choices
