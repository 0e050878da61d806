"""Failures surface as clear errors: a dead rank, and bad engine or request input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from atom import LLMEngine, SamplingParams
from atom.models.tiny import resolve_model_path
from tests.e2e.engine_helpers import ENGINE_SETTINGS

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "tiny-kimi-linear"
# A dead rank is noticed by polling; generous for a loaded 2-core machine.
DEAD_RANK_DEADLINE_S = 60.0


def step_until_error(engine: LLMEngine, deadline_s: float) -> BaseException | None:
    """Step in a helper thread, so a hang fails the test instead of blocking it."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException as exc:  # noqa: B036 - handed to the test thread
            caught.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), f"the engine hung for {deadline_s:.0f} s"
    return caught[0] if caught else None


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_killed_rank_raises_naming_the_rank(victim):
    engine = LLMEngine(MODEL, pipeline_parallel_size=2, **ENGINE_SETTINGS)
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        for i in range(4):
            engine.add_request([5 + i] * 20, params)
        for _ in range(3):
            engine.step()  # mid-run: batches are in flight
        os.kill(engine.workers.procs[victim].pid, signal.SIGKILL)
        started = time.monotonic()
        error = step_until_error(engine, DEAD_RANK_DEADLINE_S)
        print(f"rank {victim} death noticed in {time.monotonic() - started:.1f} s")
        assert isinstance(error, RuntimeError), f"got {error!r}"
        # The killed rank is named, not a survivor whose send/recv then broke.
        killed = f"rank {victim} (pp_rank {victim}, tp_rank 0) exited with code -9"
        assert str(error).startswith(killed), str(error)[:300]
        # The engine stays broken, and says so again instead of hanging.
        engine.add_request([7] * 4, params)
        again = step_until_error(engine, DEAD_RANK_DEADLINE_S)
        assert isinstance(again, RuntimeError), f"got {again!r}"
    finally:
        engine.close()
    assert not any(proc.is_alive() for proc in engine.workers.procs)


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(MODEL, **ENGINE_SETTINGS)
    yield engine
    engine.close()


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("", "prompt is empty"),
        ([[]], "prompt is empty"),
        ([1] * ENGINE_SETTINGS["max_model_len"], "max_model_len=256"),
        ([3, 4096], "[0, 4096)"),
        ([3, -1], "[0, 4096)"),
    ],
)
def test_bad_prompt_is_refused_and_the_engine_goes_on(engine, prompt, message):
    with pytest.raises(ValueError) as refused:
        engine.generate(prompt, SamplingParams(temperature=0, max_tokens=2))
    assert message in str(refused.value)
    assert not engine.has_unfinished_requests()
    out = engine.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0]["token_ids"]) == 2


def test_bad_prompt_in_a_batch_adds_none_of_it(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([[3, 4], []], SamplingParams(temperature=0, max_tokens=2))
    assert not engine.has_unfinished_requests()


def copy_with_config(tmp_path: Path, **changes) -> str:
    source = Path(resolve_model_path(MODEL))
    for item in source.iterdir():
        if item.name != "config.json":
            os.symlink(item, tmp_path / item.name)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(tensor_paralel_size=2), TypeError, "tensor_paralel_size"),
        (dict(tensor_parallel_size=3), ValueError, "tensor_parallel_size=3"),
        (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size"),
        (dict(pipeline_parallel_size=5), ValueError, "pipeline_parallel_size=5"),
        (dict(pp_layer_partition=[3, 2]), ValueError, "partition"),
        (dict(model="/no/such/model"), ValueError, "/no/such/model"),
        (dict(model="tiny-kimi-k9"), ValueError, "tiny-kimi-k9"),
    ],
)
def test_bad_engine_arguments_are_refused(kwargs, error, message):
    kwargs = {"model": MODEL, **ENGINE_SETTINGS, **kwargs}
    with pytest.raises(error) as refused:
        LLMEngine(**kwargs)
    assert message in str(refused.value)


def test_unknown_architecture_is_refused(tmp_path):
    path = copy_with_config(tmp_path, architectures=["NoSuchModelForCausalLM"])
    with pytest.raises(ValueError, match="NoSuchModelForCausalLM"):
        LLMEngine(path, **ENGINE_SETTINGS)


UNGUARDED_SCRIPT = """
from atom import LLMEngine, SamplingParams

llm = LLMEngine("tiny-kimi-linear", pipeline_parallel_size=2, device="cpu")
print(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2)))
"""


def test_a_script_without_the_main_guard_gets_one_clear_error(tmp_path):
    """Each rank imports the main script again (multiprocessing's fork server, as
    spawn did); those ranks stop silently and the engine says once what the script
    lacks, instead of one traceback per rank."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr, done.stderr[-2000:]
    assert "stopped at start" in done.stderr
    assert done.stderr.count("Traceback") == 1, done.stderr[-4000:]
