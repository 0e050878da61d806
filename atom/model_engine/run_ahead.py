"""Async scheduling: a decoding sequence runs ahead of its sampled tokens.

With `async_scheduling` the engine keeps two batches in flight at tp = pp = 1: while
the device runs step n + 1, the host finishes step n (postprocess, detokenize,
deliver) and schedules step n + 2, so the host's work hides behind the device's
instead of adding to it. Step n + 1 is scheduled before step n's tokens reach the
host: a sequence decoding in step n runs in step n + 1 with placeholder inputs
(`SeqWork.input_pending`), which the runner fills on the device from step n's
sampled tokens (`pending_tokens.py`).

With speculation, step n also decides how many of its drafts each sequence keeps,
and step n + 1 verifies the drafts step n proposed. The scheduler counts every
draft of step n as accepted (`SeqWork.unconfirmed_drafts`) and holds blocks for
that many rows; on the device the runner takes the rejected rows back from the
positions, slots and context lengths, commits each recurrent state to its last
accepted row, and fills in the anchor and the new drafts. The host learns what was
accepted when it postprocesses step n, before step n + 1's output.

Each token depends only on its sequence's history, seed and position (counter-based
sampling), so the outputs are those of the synchronous loop. A sequence that step
n finishes (EOS, a stop string) has its step n + 1 rows computed and dropped:
postprocess ignores rows of finished sequences, and its blocks and state slot,
freed at once, are rewritten only by later steps on the same device stream.
"""

from __future__ import annotations

from atom.config import EngineLimits
from atom.model_engine.sequence import Sequence


def runs_ahead(seq: Sequence, limits: EngineLimits, previous_batch_id: int) -> bool:
    """Whether `seq` decodes in the batch after `previous_batch_id` before that
    batch's tokens for it are on the host.

    Only when the previous batch samples it (the runner fills the inputs from that
    batch's tokens) and nothing but those tokens is pending. Sequences whose logits
    depend on the output so far (penalties, min_tokens) or that still collect prompt
    logprobs wait for the host, as does one whose pending token is certainly its
    last (max_tokens) or whose rows might pass max_model_len: counting every
    unconfirmed draft accepted, the next verify still needs all T of its drafts
    below it (`Scheduler._num_drafts_to_verify`'s rule).
    """
    if not limits.async_scheduling or seq.num_uncomputed_tokens != 0:
        return False
    if seq.in_flight_batch_ids != [previous_batch_id]:
        return False
    params = seq.sampling_params
    if params.adjusts_logits or seq.needs_prompt_logprobs:
        return False
    if seq.num_output_tokens + 1 >= params.max_tokens:
        return False
    # At most drafts_in_flight + 1 tokens arrive, then T drafts and their bonus row.
    furthest = seq.num_tokens + seq.drafts_in_flight + limits.num_speculative_tokens
    return furthest + 1 < limits.max_model_len
