"""Async scheduling (model_engine/run_ahead.py) gives the synchronous loop's outputs.

Two engines on the trained tiny K3, one with `async_scheduling`, serve the same
requests arriving at the same steps: greedy and seeded sampling, max_tokens of one,
a stop string, EOS, output and prompt logprobs and a repetition penalty (whose
sequences wait for their tokens instead of running ahead). Token ids, texts and
finish reasons must be equal, logprobs equal within float tolerance, and the async
engine must actually have run sequences ahead. On CUDA the same runs replay graphs.
"""

from __future__ import annotations

import pytest
import torch

from atom import LLMEngine, SamplingParams
from atom.config import Config
from atom.kernels import triton_available
from tests.e2e.engine_helpers import ENGINE_SETTINGS

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "tiny-kimi-k3"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def requests(stop: str | None) -> list[tuple[int, str, SamplingParams]]:
    """(arrival step, prompt, params): half arrive while the others decode."""
    greedy = dict(temperature=0, max_tokens=12)
    return [
        (0, "hello world", SamplingParams(**greedy, ignore_eos=True)),
        (0, "the cat sat", SamplingParams(temperature=0.8, top_p=0.9, seed=3)),
        (0, "one two", SamplingParams(**greedy, logprobs=2)),
        (1, "a b c", SamplingParams(temperature=0, max_tokens=1)),
        (2, "hello world", SamplingParams(**greedy, stop=[stop] if stop else None)),
        (3, "the cat sat", SamplingParams(**greedy, repetition_penalty=1.3)),
        (5, "one two", SamplingParams(**greedy, prompt_logprobs=1)),
        (5, "red green", SamplingParams(temperature=1.0, max_tokens=9)),
    ]


def serve(
    engine: LLMEngine, stop: str | None, arrivals: list | None = None
) -> tuple[dict, int]:
    """({request id: final output}, pending inputs the engine sent) for
    `arrivals` ((step, prompt, params), `requests(stop)` by default)."""
    pending = 0
    submit = engine.workers.submit

    def counting_submit(batch) -> None:
        nonlocal pending
        pending += sum(work.input_pending for work in batch.work)
        submit(batch)

    engine.workers.submit = counting_submit
    arrivals = requests(stop) if arrivals is None else list(arrivals)
    done, step = {}, 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, prompt, params = arrivals.pop(0)
            engine.add_request(prompt, params, request_id=f"r{len(arrivals)}")
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out
        step += 1
    engine.workers.submit = submit
    return done, pending


def assert_same_logprobs(a, b) -> None:
    assert (a is None) == (b is None)
    for x, y in zip(a or [], b or []):
        if x is None or y is None:
            assert x is y
            continue
        assert x.token_id == y.token_id
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def assert_same_outputs(got: dict, expected: dict) -> None:
    """The same requests with the same tokens, text, finish reason and logprobs."""
    assert sorted(got) == sorted(expected)
    for request_id, want in expected.items():
        out = got[request_id]
        assert out.output_token_ids == want.output_token_ids, request_id
        assert out.text == want.text
        assert out.finish_reason == want.finish_reason
        assert_same_logprobs(out.logprobs, want.logprobs)
        assert_same_logprobs(out.prompt_logprobs, want.prompt_logprobs)


@pytest.mark.parametrize("device", DEVICES)
def test_async_scheduling_gives_the_synchronous_outputs(device):
    settings = dict(ENGINE_SETTINGS, device=device)
    if device == "cuda":
        settings |= dict(dtype="float32", cudagraph_capture_sizes=[1, 2, 4, 8])
    # A stop string the first greedy request meets after a few tokens.
    probe = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for flag in (False, True):
        engine = LLMEngine(MODEL, async_scheduling=flag, **settings)
        try:
            text = engine.generate("hello world", probe)[0]["text"]
            outputs.append(serve(engine, text[4:6] or None))
        finally:
            engine.close()
    (expected, none_pending), (got, pending) = outputs
    stop = text[4:6] or None
    assert none_pending == 0
    assert pending > 0, "no sequence ran ahead of its token"
    assert_same_outputs(got, expected)
    reasons = {out.finish_reason for out in got.values()}
    assert "length" in reasons and ("stop" in reasons or stop is None)


def dspark_requests(stop: list[str]) -> list[tuple[int, str, SamplingParams]]:
    """Requests that verify drafts: greedy and sampled ones running ahead, one near
    max_model_len (its last verifies wait for the host), a stop string, and one
    that joins while the others verify."""
    greedy = dict(temperature=0, ignore_eos=True)
    return [
        (0, "hello world", SamplingParams(**greedy, max_tokens=40)),
        (0, "the cat sat", SamplingParams(temperature=0.8, seed=5, max_tokens=30)),
        (0, "one two", SamplingParams(temperature=0, max_tokens=25)),
        (2, "red green", SamplingParams(**greedy, max_tokens=17, stop=stop)),
        (4, "a b c", SamplingParams(**greedy, max_tokens=2)),
        (6, "hello world", SamplingParams(**greedy, max_tokens=57)),
    ]


@pytest.mark.parametrize(
    "device, kernels",
    [("cpu", False), pytest.param("cpu", True, marks=pytest.mark.kernels)]
    + [("cuda", True)] * ("cuda" in DEVICES),
)
def test_async_scheduling_with_dspark_gives_the_synchronous_outputs(device, kernels):
    """Verifies run ahead of their acceptance: the rejected drafts are taken back
    on the device, and every token, text and finish reason is the synchronous
    engine's. On CUDA the verifies replay graphs, and the pending rows and the
    greedy verify take their one-launch kernels there (on CPU, with `kernels`,
    through Triton's interpreter)."""
    if kernels and device == "cpu" and not triton_available("cpu"):
        pytest.skip("triton cannot run on the CPU here (no TRITON_INTERPRET=1)")
    settings = dict(
        ENGINE_SETTINGS,
        device=device,
        method="dspark",
        draft_model="tiny-kimi-k3-dspark",
        num_speculative_tokens=3,
        max_model_len=64,
    )
    if device == "cuda":
        settings |= dict(dtype="float32", cudagraph_capture_sizes=[1, 2, 4, 8])
    outputs, stats = [], []
    for flag in (False, True):
        engine = LLMEngine(MODEL, async_scheduling=flag, **settings)
        try:
            runner = engine.workers.runner
            if flag and kernels and device == "cpu":
                # Against the synchronous engine's torch path.
                runner.bookkeeping_kernels = True
                runner.step_sampler.greedy_verify_kernel = True
            assert runner.bookkeeping_kernels == (
                kernels and (flag or device == "cuda")
            )
            outputs.append(serve(engine, None, dspark_requests(["will not"])))
            stats.append(engine.get_spec_decode_stats())
        finally:
            engine.close()
    (expected, none_pending), (got, pending) = outputs
    assert none_pending == 0
    assert pending > 0, "no verify ran ahead of its acceptance"
    assert_same_outputs(got, expected)
    assert {out.finish_reason for out in got.values()} == {"length", "stop"}
    assert stats[0] == stats[1]
    assert 0 < stats[1]["total_accepted_tokens"] < stats[1]["total_draft_tokens"]


@pytest.mark.parametrize(
    "setting, named",
    [
        (dict(tensor_parallel_size=2), "tensor_parallel_size=2"),
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
    ],
)
def test_async_scheduling_refuses_what_it_cannot_run(setting, named):
    with pytest.raises(ValueError, match="async_scheduling does not run with") as err:
        Config(model=MODEL, device="cpu", async_scheduling=True, **setting)
    assert named in str(err.value)


@pytest.mark.parametrize(
    "device, setting, expected",
    [
        ("cpu", {}, False),  # the host is the device: nothing to overlap
        ("cuda", {}, True),
        ("cuda", dict(tensor_parallel_size=2), False),
        ("cuda", dict(method="dspark", draft_model="tiny-kimi-k3-dspark"), True),
    ],
)
def test_async_scheduling_left_unset_runs_wherever_it_can_on_a_gpu(
    device, setting, expected
):
    """A Config only resolves settings (no device is touched), so the GPU cases
    hold on CPU too."""
    config = Config(model=MODEL, device=device, **setting)
    assert config.async_scheduling is expected
    assert config.limits.async_scheduling is expected
    assert f"async scheduling {'on' if expected else 'off'}" in (
        config.describe_settings()
    )
