"""Penalties, logit_bias and min_tokens keep DSpark lossless: greedy DSpark output
equals target-only output with the same settings, on the trained tiny K3 and its
shipped draft (pp1 x tp1), while the settings do change the output."""

from dataclasses import replace

import pytest

from atom.sampling_params import SamplingParams
from tests.e2e.pp_probe import (
    GREEDY,
    PAIRS,
    acceptance,
    corpus_prompts,
    generate_ids,
    make_engine,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")
PP2_TP2 = dict(pipeline_parallel_size=2, tensor_parallel_size=2)


def test_greedy_dspark_with_penalties_equals_target_only():
    target, draft = PAIRS["k3"]
    prompts = corpus_prompts()
    engine = make_engine(target)
    plain = generate_ids(engine, prompts)
    # The token the plain continuations use most is banned, and one is boosted.
    flat = [t for ids in plain for t in ids]
    banned = max(set(flat), key=flat.count)
    boosted = min(set(flat), key=flat.count)
    eos = engine.scheduler.eos_token_ids
    params = SamplingParams(
        temperature=0.0,
        max_tokens=GREEDY.max_tokens,
        frequency_penalty=0.6,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={banned: -100.0, boosted: 1.5},
        min_tokens=4,
    )
    target_only = generate_ids(engine, prompts, params)
    # A stop token ends the request where it is first emitted, and is kept.
    stop = plain[0][2]
    stopped = generate_ids(engine, prompts[:1], replace(GREEDY, stop_token_ids=[stop]))
    engine.close()
    assert stopped == [plain[0][: plain[0].index(stop) + 1]]
    engine = make_engine(target, draft)
    speculative = generate_ids(engine, prompts, params)
    accepted = acceptance(engine)
    engine.close()
    assert speculative == target_only
    assert target_only != plain
    assert all(banned not in ids for ids in target_only)
    assert all(not eos & set(ids[:4]) for ids in target_only)
    # Drafts were accepted in blocks, so rows counting earlier drafts were used.
    assert accepted > 0.1


def test_logprobs_under_dspark_equal_target_only():
    """The verified tokens' logprobs are the target's: the same as target-only
    decoding (penalties on), greedy tokens are the top-1 alternative."""
    target, draft = PAIRS["k3"]
    prompts = corpus_prompts()[:2]
    params = replace(GREEDY, logprobs=3, frequency_penalty=0.5)
    results = []
    for pair in ((target,), (target, draft)):
        engine = make_engine(*pair)
        results.append(engine.generate(prompts, params))
        engine.close()
    for alone, speculative in zip(*results):
        assert speculative["token_ids"] == alone["token_ids"]
        assert [lp.token_id for lp in alone["logprobs"]] == alone["token_ids"]
        for a, s in zip(alone["logprobs"], speculative["logprobs"]):
            assert s.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert [i for i, _ in s.top] == [i for i, _ in a.top]
            assert len(a.top) == 3 and a.top[0] == (a.token_id, a.logprob)
            assert a.logprob <= 0


def test_prompt_logprobs_match_the_golden_model_with_chunks_and_cached_prefixes(
    golden_oracle,
):
    """Prompts of 70 and 33 tokens prefill in chunks of 32 under DSpark (the 33rd
    token runs as a decode-shaped step); the second run of the same prompts finds
    their blocks cached and must still score every position."""
    target, draft = PAIRS["k3"]
    prompts = corpus_prompts((70, 33))
    engine = make_engine(target, draft)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    runs = [engine.generate(prompts, params) for _ in range(2)]
    engine.close()
    golden = golden_oracle.model(target)
    for prompt, first, again in zip(prompts, *runs):
        want = golden(prompt)[0].log_softmax(dim=-1)
        got = first["prompt_logprobs"]
        assert got[0] is None and len(got) == len(prompt)
        assert [lp.token_id for lp in got[1:]] == prompt[1:]
        for position, lp in enumerate(got[1:], start=1):
            assert lp.logprob == pytest.approx(
                float(want[position - 1, prompt[position]]), abs=2e-3
            )
            assert [i for i, _ in lp.top] == want[position - 1].topk(2).indices.tolist()
        assert [lp.logprob for lp in again["prompt_logprobs"][1:]] == pytest.approx(
            [lp.logprob for lp in got[1:]], abs=1e-5
        )


@pytest.mark.slow
def test_pp2_tp2_dspark_gives_the_pp1_tokens_and_logprobs():
    """Penalties, bias, logprobs and prompt logprobs under pp2 x tp2 with DSpark
    (rank processes over gloo): the last stage's TP ranks score the same rows."""
    target, draft = PAIRS["k3"]
    prompts = corpus_prompts()[2:]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=GREEDY.max_tokens,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={7: 3.0},
        logprobs=2,
        prompt_logprobs=1,
    )
    results = []
    for pair, layout in (((target,), {}), ((target, draft), PP2_TP2)):
        engine = make_engine(*pair, **layout)
        results.append(engine.generate(prompts, params))
        engine.close()
    for alone, split in zip(*results):
        assert split["token_ids"] == alone["token_ids"]
        for key in ("logprobs", "prompt_logprobs"):
            pairs = [(a, s) for a, s in zip(alone[key], split[key]) if a is not None]
            assert len(pairs) == len(alone[key]) - (key == "prompt_logprobs")
            for a, s in pairs:
                assert (s.token_id, [i for i, _ in s.top]) == (
                    a.token_id,
                    [i for i, _ in a.top],
                )
                assert s.logprob == pytest.approx(a.logprob, abs=1e-3)
