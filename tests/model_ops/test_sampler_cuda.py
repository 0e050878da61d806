"""On a CUDA device: sampling, verification and the Markov decode never wait for
the device, a step copies to the host once, and CUDA draws what CPU draws.

Skipped without CUDA. torch's sync debug mode turns every synchronising call
(.item(), .tolist(), nonzero, a blocking copy) into an error or a warning.
"""

import warnings
from contextlib import contextmanager

import pytest
import torch

from atom.model_engine.batch import SeqWork
from atom.model_engine.step_sampler import StepSampler
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


@torch.inference_mode()
def test_a_step_copies_to_the_host_once():
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
        )
        for s in range(SEQS)
    ]
    sampling = SamplingMetadata.from_works(works, "cuda")
    sampler = StepSampler()
    q = torch.softmax(torch.randn(SEQS, WIDTH, VOCAB, device="cuda"), -1)
    ids = torch.zeros(SEQS, WIDTH, dtype=torch.long, device="cuda")
    sampler.store_draft_probs(sampling, DraftOutput(ids, q))
    logits = torch.randn(sampling.logit_rows.numel(), VOCAB, device="cuda")
    with sync_debug("warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choices = sampler.step(logits, sampling)
    synchronising = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(synchronising) == 1, [str(w.message) for w in synchronising]
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
