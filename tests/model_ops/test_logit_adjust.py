"""LogitAdjustments against a direct per-token reference, in plain sampling rows and
in verify rows (where each row counts the drafts before it), and the sampler
skipping the work when no request asks for it."""

import math

import torch

from atom.model_engine.batch import LogitAdjustWork
from atom.model_ops.logit_adjust import LogitAdjustments
from atom.model_ops.sampling_metadata import SamplingMetadata

VOCAB = 12


def reference(
    row: list[float], adjust: LogitAdjustWork, drafts_before: list[int]
) -> list[float]:
    """The documented rules, one token at a time; the drafts before the row count
    as output."""
    history = adjust.output_token_ids + drafts_before
    num_outputs = adjust.num_output_tokens + len(drafts_before)
    out = []
    for token, logit in enumerate(row):
        count = history.count(token)
        if count or token in adjust.prompt_token_ids:
            r = adjust.repetition_penalty
            logit = logit / r if logit > 0 else logit * r
        logit -= adjust.frequency_penalty * count
        logit -= adjust.presence_penalty * (count > 0)
        logit += adjust.logit_bias.get(token, 0.0)
        if token in adjust.banned_until_min_tokens and num_outputs < adjust.min_tokens:
            logit = -math.inf
        out.append(logit)
    return out


ADJUSTS = [
    LogitAdjustWork(
        frequency_penalty=0.7,
        presence_penalty=-0.4,
        output_token_ids=[3, 3, 5],
        num_output_tokens=3,
    ),
    None,  # a request without adjustments keeps its logits
    LogitAdjustWork(
        repetition_penalty=1.8,
        prompt_token_ids=[0, 2, 9],
        output_token_ids=[4],
        num_output_tokens=1,
        logit_bias={1: -100.0, 7: 2.5},
    ),
    LogitAdjustWork(
        min_tokens=3, banned_until_min_tokens=[10, 11], num_output_tokens=1
    ),
]


def test_verify_rows_match_the_reference_with_the_drafts_before_them():
    gen = torch.Generator().manual_seed(0)
    width = 4  # [last] + 3 drafts
    logits = torch.randn(len(ADJUSTS), width, VOCAB, generator=gen) * 3
    drafts = torch.tensor([[3, 5, 6], [1, 1, 1], [4, 2, 8], [10, 0, 0]])
    num_drafts = torch.tensor([3, 3, 2, 1])
    adjust = LogitAdjustments.build(ADJUSTS, "cpu")
    got = adjust.apply(logits, drafts, num_drafts)
    for s, work in enumerate(ADJUSTS):
        for j in range(int(num_drafts[s]) + 1):  # later rows are padding
            if work is None:
                want = logits[s, j].tolist()
            else:
                before = drafts[s, :j].tolist()
                want = reference(logits[s, j].tolist(), work, before)
            torch.testing.assert_close(got[s, j], torch.tensor(want))


def test_plain_rows_and_the_fast_path():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(ADJUSTS), 1, VOCAB, generator=gen)
    got = LogitAdjustments.build(ADJUSTS, "cpu").apply(logits)
    want = reference(logits[0, 0].tolist(), ADJUSTS[0], [])
    torch.testing.assert_close(got[0, 0], torch.tensor(want))
    assert got[2, 0, 1] < -90 and got[3, 0, 10] == -math.inf
    # No request adjusts anything: nothing is built, the step skips the work.
    assert SamplingMetadata.build([0.0, 0.5], seeds=[1, 2]).adjust is None
    assert LogitAdjustments.build([None, None], "cpu") is None
