"""What the last stage needs to choose one step's tokens, built once per step.

Tensors live on the step's device, one row per sampled sequence in batch order;
the few host-side facts (which rows are greedy, whether any row uses top-k or
top-p, the draft counts) come from the scheduler's lists, so reading them never
waits for the device.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atom.model_ops.host_copy import host_to_device, hosts_to_device
from atom.model_ops.logit_adjust import LogitAdjustments
from atom.model_ops.logprobs import LogprobRequest

if TYPE_CHECKING:
    from atom.model_engine.batch import LogitAdjustWork, SeqWork


def per_row(values: object, count: int, name: str) -> list:
    """One entry per row: a scalar repeats; a sequence or tensor must have `count`."""
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist()
    if isinstance(values, Sequence):
        if len(values) != count:
            raise ValueError(f"{name}: {len(values)} values for {count} rows")
        return list(values)
    return [values] * count


def _padded(
    rows: list[list[int]], repeat_last: bool = False
) -> tuple[list[int], torch.dtype, tuple[int, int]]:
    """A `hosts_to_device` field: [len(rows), longest] long, short rows padded with
    0 (or their last entry), as one flat list (a nested one converts to a tensor
    element by element)."""
    lengths = [len(row) for row in rows]
    width = max(lengths, default=0)
    if any(length != width for length in lengths):
        rows = [
            row + (row[-1:] if repeat_last else [0]) * (width - len(row))
            for row in rows
        ]
    return list(itertools.chain.from_iterable(rows)), torch.long, (len(rows), width)


@dataclass(frozen=True)
class SpecRows:
    """Host lists of a verify step, one entry per sampled sequence."""

    drafts: list[list[int]]
    row_index: list[list[int]]
    # None when the engine drafts nothing (padding them is the step's largest
    # host cost at large batches).
    block_tables: list[list[int]] | None


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """The drafts each sampled sequence verifies this step and where it drafts next."""

    # [S, T] long, T = the batch's largest draft count; row s holds its
    # num_drafts[s] drafts, then zeros.
    draft_ids: torch.Tensor
    # [S] long, and the same counts on the host.
    num_drafts: torch.Tensor
    num_drafts_host: list[int]
    # [S, T + 1] long: the scored-logits row of verify row j of sequence s (row j
    # predicts the token after draft j); padding repeats the sequence's last row.
    row_index: torch.Tensor
    # [S, W] long: paged-KV block ids of each sampled sequence for the drafter's
    # block pass, padded with block 0 (never read past the sequence's context);
    # None when the engine drafts nothing.
    block_tables: torch.Tensor | None

    @property
    def max_drafts(self) -> int:
        return max(self.num_drafts_host, default=0)


@dataclass(frozen=True)
class SamplingMetadata:
    """Per sampled sequence: its sampling settings and the positions it decides."""

    seq_ids: list[int]
    temperatures: torch.Tensor  # [S] float32; 0 = greedy
    top_ks: torch.Tensor  # [S] long; <= 0 (or >= vocab) keeps every token
    top_ps: torch.Tensor  # [S] float32 in (0, 1]
    seeds: torch.Tensor  # [S] int64 (0 for greedy rows without one)
    # [S] long: the position of the token the sequence's first scored row predicts
    # (the sampled token, or the first draft when verifying).
    positions: torch.Tensor
    greedy: torch.Tensor  # [S] bool
    greedy_host: list[bool]
    # [S'] long: the rows with temperature > 0.
    sampled_index: torch.Tensor
    uses_top_k: bool
    uses_top_p: bool
    # [R] long: rows of the step's hidden states whose logits are scored.
    logit_rows: torch.Tensor | None = None
    spec: SpecDecodeMetadata | None = None
    # Penalties, bias and min_tokens of the rows that ask for them; None when no
    # row does (the step skips the adjustment).
    adjust: LogitAdjustments | None = None
    # The rows whose emitted tokens' logprobs are reported; None when none.
    logprobs: LogprobRequest | None = None
    # Every row of the forward is scored, in order (logit_rows is 0 .. N - 1):
    # `scored_rows` then takes the hidden states as they are, without a gather.
    scores_every_row: bool = False
    # Built for plain decode: every work samples its one row, without drafts,
    # adjustments or logprobs (the next such step over the same sequences reuses
    # these tensors: `from_works`'s `previous`).
    plain_decode: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.greedy_host)

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy_host)

    def scored_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of the forward's hidden states [N, H] whose logits are scored."""
        return hidden if self.scores_every_row else hidden[self.logit_rows]

    @classmethod
    def build(
        cls,
        temperatures: Sequence[float],
        top_ks: Sequence[int] | int = -1,
        top_ps: Sequence[float] | float = 1.0,
        seeds: Sequence[int | None] | int | None = None,
        positions: Sequence[int] | int = 0,
        device: torch.device | str = "cpu",
        seq_ids: Sequence[int] | None = None,
        logit_rows: Sequence[int] | None = None,
        spec_rows: SpecRows | None = None,
        logit_adjusts: Sequence[LogitAdjustWork | None] | None = None,
        logprobs: Sequence[int | None] | None = None,
        plain_decode: bool = False,
        scores_every_row: bool = False,
    ) -> SamplingMetadata:
        """From host values, one per sequence (a scalar applies to all).

        A greedy row may have seed None; a sampled row needs an int seed.
        `logit_adjusts` holds one LogitAdjustWork or None per sequence, `logprobs`
        the top count each sequence wants reported (None: no logprobs). Every
        tensor reaches the device in one copy per dtype (`hosts_to_device`).
        """
        num_seqs = len(temperatures)
        temps = [float(t) for t in temperatures]
        ks = [int(k) for k in per_row(top_ks, num_seqs, "top_ks")]
        ps = [float(p) for p in per_row(top_ps, num_seqs, "top_ps")]
        seed_list = per_row(seeds, num_seqs, "seeds")
        pos = [int(p) for p in per_row(positions, num_seqs, "positions")]
        bad = [t for t in temps if not math.isfinite(t) or t < 0]
        if bad:
            raise ValueError(f"temperatures must be finite and >= 0, got {bad}")
        bad = [p for p in ps if not 0 < p <= 1]
        if bad:
            raise ValueError(f"top_ps must lie in (0, 1], got {bad}")
        greedy = [t == 0 for t in temps]
        for row, (seed, is_greedy) in enumerate(zip(seed_list, greedy)):
            if seed is None and not is_greedy:
                raise ValueError(
                    f"sequence row {row} samples (temperature {temps[row]}) without "
                    "a seed; the engine gives every request one when it is added"
                )

        sampled = [i for i, g in enumerate(greedy) if not g]
        rows = [] if logit_rows is None else list(logit_rows)
        fields = [
            (temps, torch.float32, (num_seqs,)),
            (ks, torch.long, (num_seqs,)),
            (ps, torch.float32, (num_seqs,)),
            ([0 if s is None else s for s in seed_list], torch.long, (num_seqs,)),
            (pos, torch.long, (num_seqs,)),
            (sampled, torch.long, (len(sampled),)),
            (rows, torch.long, (len(rows),)),
            # As longs, so the flags travel with the other longs.
            ([int(g) for g in greedy], torch.long, (num_seqs,)),
        ]
        if spec_rows is not None:
            counts = [len(d) for d in spec_rows.drafts]
            fields += [
                _padded(spec_rows.drafts),
                (counts, torch.long, (len(counts),)),
                # Padding repeats the last row, so every index is a real row.
                _padded(spec_rows.row_index, repeat_last=True),
            ]
            if spec_rows.block_tables is not None:
                fields.append(_padded(spec_rows.block_tables))
        temps_t, ks_t, ps_t, seeds_t, pos_t, sampled_t, rows_t, greedy_t, *spec_t = (
            hosts_to_device(fields, device)
        )
        spec = None
        if spec_rows is not None:
            draft_ids, num_drafts, row_index, *block_tables = spec_t
            spec = SpecDecodeMetadata(
                draft_ids=draft_ids,
                num_drafts=num_drafts,
                num_drafts_host=counts,
                row_index=row_index,
                block_tables=block_tables[0] if block_tables else None,
            )
        return cls(
            seq_ids=list(seq_ids) if seq_ids is not None else list(range(num_seqs)),
            temperatures=temps_t,
            top_ks=ks_t,
            top_ps=ps_t,
            seeds=seeds_t,
            positions=pos_t,
            greedy=greedy_t.bool(),
            greedy_host=greedy,
            sampled_index=sampled_t,
            uses_top_k=any(k > 0 and not g for k, g in zip(ks, greedy)),
            uses_top_p=any(p < 1 and not g for p, g in zip(ps, greedy)),
            logit_rows=None if logit_rows is None else rows_t,
            spec=spec,
            adjust=LogitAdjustments.build(logit_adjusts or [], device),
            logprobs=LogprobRequest.build(logprobs or [], device),
            plain_decode=plain_decode,
            scores_every_row=scores_every_row,
        )

    @classmethod
    def from_works(
        cls,
        works: Sequence[SeqWork],
        device: torch.device | str,
        drafts_next: bool,
        previous: SamplingMetadata | None = None,
    ) -> SamplingMetadata:
        """The step's metadata for the sequences with `sample` set, in batch order;
        their block tables only when `drafts_next` (the engine proposes drafts).

        `previous`, the last step's metadata, lends its tensors when both steps are
        plain decode of the same sequences in the same order: a sequence's sampling
        settings never change, so only the positions are new. Steady decode then
        builds one list instead of a dozen, the host's largest sampling cost at
        large batches.
        """
        plain = not drafts_next and all(_plain_decode(work) for work in works)
        if plain and previous is not None and previous.plain_decode:
            if [work.seq_id for work in works] == previous.seq_ids:
                positions = [work.context_len + 1 for work in works]
                moved = host_to_device(positions, torch.long, device)
                return dataclasses.replace(previous, positions=moved)
        logit_rows: list[int] = []
        row_index: list[list[int]] = []
        drafts: list[list[int]] = []
        sampled: list[SeqWork] = []
        end = 0
        for work in works:
            end += len(work.token_ids)
            if work.sample:
                num_drafts = work.num_drafts
                first = len(logit_rows)
                logit_rows.extend(range(end - 1 - num_drafts, end))
                row_index.append(list(range(first, first + num_drafts + 1)))
                drafts.append(work.token_ids[1 : 1 + num_drafts])
                sampled.append(work)
        spec_rows = SpecRows(
            drafts=drafts,
            row_index=row_index,
            block_tables=[w.block_table for w in sampled] if drafts_next else None,
        )
        return cls.build(
            temperatures=[w.temperature for w in sampled],
            top_ks=[w.top_k for w in sampled],
            top_ps=[w.top_p for w in sampled],
            seeds=[w.seed for w in sampled],
            positions=[
                w.context_len + len(w.token_ids) - w.num_drafts for w in sampled
            ],
            device=device,
            seq_ids=[w.seq_id for w in sampled],
            logit_rows=logit_rows,
            spec_rows=spec_rows,
            logit_adjusts=[w.logit_adjust for w in sampled],
            logprobs=[w.logprobs for w in sampled],
            plain_decode=plain,
            # The rows only ever increase, so as many as the forward's are all.
            scores_every_row=len(logit_rows) == end,
        )


def _plain_decode(work: SeqWork) -> bool:
    """One sampled row, no drafts, no logit adjustments, no logprobs."""
    return (
        work.sample
        and len(work.token_ids) == 1
        and work.logit_adjust is None
        and work.logprobs is None
    )
