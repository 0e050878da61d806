"""On a CUDA device: sampling, verification, logit adjustments, logprobs and the
Markov decode never wait for the device, a step copies to the host once (logprobs
add two copies), and CUDA draws what CPU draws.

Skipped without CUDA. torch's sync debug mode turns every synchronising call
(.item(), .tolist(), nonzero, a blocking copy) into an error or a warning.
"""

from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from atom.model_engine.batch import LogitAdjustWork, SeqWork
from atom.model_engine.step_sampler import StepSampler
from atom.model_ops.logit_adjust import LogitAdjustments
from atom.model_ops.logprobs import LogprobRequest
from atom.model_ops.rejection_sampler import verify_drafts
from atom.model_ops.sampler import sample_tokens
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.models.dspark_base import MarkovHead
from atom.spec_decode.draft_output import DraftOutput
from atom.spec_decode.markov_head import markov_decode

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"
)

VOCAB, SEQS, WIDTH = 4096, 64, 3
SETTINGS = dict(
    temperatures=[0.0 if s % 4 == 0 else 0.7 + 0.01 * s for s in range(SEQS)],
    top_ks=[0 if s % 3 else 50 for s in range(SEQS)],
    top_ps=[1.0 if s % 5 else 0.9 for s in range(SEQS)],
    seeds=list(range(1000, 1000 + SEQS)),
    positions=[10 + s for s in range(SEQS)],
)


@contextmanager
def sync_debug(mode: str):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def inputs(device: str):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(SEQS, WIDTH + 1, VOCAB, generator=gen) * 3
    drafts = torch.randint(0, VOCAB, (SEQS, WIDTH), generator=gen)
    q = torch.softmax(torch.randn(SEQS, WIDTH, VOCAB, generator=gen), -1)
    counts = torch.arange(SEQS) % (WIDTH + 1)
    sampling = SamplingMetadata.build(**SETTINGS, device=device)
    return [t.to(device) for t in (logits, drafts, q, counts)] + [sampling]


def markov_head(device: str) -> MarkovHead:
    head = MarkovHead(VOCAB, 8)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head.markov_w1.weight.copy_(torch.randn(VOCAB, 8, generator=gen))
        head.markov_w2.weight.copy_(torch.randn(VOCAB, 8, generator=gen))
    return head.to(device)


@torch.inference_mode()
def test_batched_sampling_verification_and_drafting_never_synchronise():
    logits, drafts, q, counts, sampling = inputs("cuda")
    head = markov_head("cuda")
    anchors, positions = drafts[:, 0].clone(), sampling.positions.clone()
    with sync_debug("error"):
        sample_tokens(logits[:, 0], sampling)
        verify_drafts(logits, drafts, counts, q, sampling)
        verify_drafts(logits, drafts, counts, None, sampling)
        markov_decode(logits[:, :WIDTH], anchors, positions, head.bias, sampling)


def adjust_work(s: int) -> LogitAdjustWork | None:
    """Penalties, bias and min_tokens on two of every three sequences."""
    if s % 3 == 0:
        return None
    return LogitAdjustWork(
        frequency_penalty=0.5,
        presence_penalty=0.2,
        repetition_penalty=1.1,
        logit_bias={s: -100.0, s + 1: 5.0},
        min_tokens=4,
        banned_until_min_tokens=[0, 1],
        output_token_ids=[3, 4, 3],
        prompt_token_ids=[5, 6],
        num_output_tokens=3,
    )


@torch.inference_mode()
def test_logit_adjustments_and_logprobs_never_synchronise_and_match_cpu():
    got = {}
    for device in ("cpu", "cuda"):
        logits, drafts, _, counts, _ = inputs(device)
        adjust = LogitAdjustments.build([adjust_work(s) for s in range(SEQS)], device)
        wanted = LogprobRequest.build([s % 2 or None for s in range(SEQS)], device)
        with sync_debug("error") if device == "cuda" else nullcontext():
            adjusted = adjust.apply(logits, drafts, counts)
            logprobs = wanted.compute(adjusted, drafts.new_zeros(SEQS, WIDTH + 1))
        got[device] = [adjusted.cpu(), *(t.cpu() for t in logprobs)]
    for cpu, cuda in zip(got["cpu"], got["cuda"]):
        if cpu.is_floating_point():
            torch.testing.assert_close(cuda, cpu, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("logprobs, copies", [(None, 1), (2, 3)])
def test_a_step_copies_to_the_host_once(logprobs, copies):
    """With adjustments on, once; logprobs add their two copies. Launching the
    step waits for nothing (async scheduling queues the next forward meanwhile)."""
    works = [
        SeqWork(
            seq_id=s,
            token_ids=[7, 8, 9][: 1 + s % 3],
            context_len=20,
            block_table=[s],
            state_slot=s,
            num_drafts=s % 3,
            temperature=SETTINGS["temperatures"][s],
            top_k=SETTINGS["top_ks"][s],
            top_p=SETTINGS["top_ps"][s],
            seed=SETTINGS["seeds"][s],
            logit_adjust=adjust_work(s),
            logprobs=logprobs,
        )
        for s in range(SEQS)
    ]
    sampling = SamplingMetadata.from_works(works, "cuda", drafts_next=False)
    sampler = StepSampler()
    q = torch.softmax(torch.randn(SEQS, WIDTH, VOCAB, device="cuda"), -1)
    ids = torch.zeros(SEQS, WIDTH, dtype=torch.long, device="cuda")
    sampler.store_draft_probs(sampling, DraftOutput(ids, q))
    logits = torch.randn(sampling.logit_rows.numel(), VOCAB, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with sync_debug("error"):
            sampled = sampler.launch(logits, sampling)
        choices = sampled.choices()
    to_host = [e for e in prof.events() if "Memcpy DtoH" in e.name]
    assert len(to_host) == copies, [e.name for e in to_host]
    assert len(choices) == SEQS


@torch.inference_mode()
def test_cuda_chooses_what_cpu_chooses():
    """Same uniforms bit for bit; a token may differ only where float32 rounding
    (exp, log) differs between the devices at a near tie, which is rare."""
    results = {}
    for device in ("cpu", "cuda"):
        logits, drafts, q, counts, sampling = inputs(device)
        emitted, accepted = verify_drafts(logits, drafts, counts, q, sampling)
        sampled = sample_tokens(logits[:, 0], sampling)
        results[device] = (emitted.cpu(), accepted.cpu(), sampled.cpu())
    cpu_emitted, cpu_accepted, cpu_sampled = results["cpu"]
    gpu_emitted, gpu_accepted, gpu_sampled = results["cuda"]
    assert float((cpu_sampled == gpu_sampled).float().mean()) >= 0.97
    same = (cpu_accepted == gpu_accepted) & (cpu_emitted == gpu_emitted).all(-1)
    assert float(same.float().mean()) >= 0.97
