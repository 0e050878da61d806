"""The host's work per decode step, phase by phase, on CPU.

Runs one in-process engine (tp = pp = 1) on CPU with a tiny model and times each
phase of a decode step with `time.perf_counter` around the engine's own functions:

    schedule   Scheduler.schedule              (which rows run, their SeqWorks)
    inputs     model_inputs.prepare_inputs      (the packed step buffer, its copy)
    forward    the model's forward             (device work on a GPU)
    logits     the LM head (device work on a GPU)
    sample     SamplingMetadata + StepSampler (its .tolist() is the sync)
    runner     the rest of ModelRunner.execute (cache commits, state copies, ...)
    post       Scheduler.postprocess            (append tokens, finish checks)
    output     OutputProcessor / engine output (detokenize, stop strings)
    engine     the rest of LLMEngine.step

With `--draft-model` (DSpark) a step is a verify and a draft, and two more phases
are device work on a GPU, where graphs replay them:

    draft      the drafter's block pass and its Markov head (`propose`)
    context    the draft's context rows written from the taps

Everything but `forward` and `logits` (and `draft`, `context`, and the kernels
inside `sample`) is the work a GPU does not hide; at batch 1 on an H200 it is about half of a decode step
(`benchmarks/profile_decode.py`). The timers wrap attributes of this engine's
objects only, so the engine itself carries no timing code. Each figure is the
minimum over `--repeats` runs. `--no-forward` makes the forward (and the draft) return zeros: a CPU
forward evicts the host's caches, so the phases after it run cold, while on a GPU
they run warm. It also times the step buffer a graph replay builds (tables at the
graph's fixed width, `--replay-table-width`). `--cprofile N` prints the N functions with the most own time in
steps without a forward.

    python benchmarks/host_overhead.py --batch-sizes 1,32 --steps 64 --no-forward
    python benchmarks/host_overhead.py --batch-sizes 128 --input-len 256 --no-forward
    python benchmarks/host_overhead.py --batch-sizes 1 --no-forward \
        --draft-model tiny-kimi-k3-dspark
    python benchmarks/host_overhead.py --batch-sizes 1 --no-forward \
        --draft-model tiny-kimi-k3-dspark --async-scheduling

With `--async-scheduling` (a GPU's default) steps run ahead of their tokens, and
`inputs` also holds the repair of the pending rows (pending_tokens.py).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import pstats
import random
import time
import timeit
from collections import defaultdict
from collections.abc import Callable

import torch

from atom import LLMEngine, SamplingParams
from atom.model_engine import model_runner as model_runner_module
from atom.model_engine.batch import SeqWork
from atom.model_engine.model_inputs import SeqPadding, build_step
from atom.spec_decode.draft_output import DraftOutput

PHASES = (
    "schedule",
    "inputs",
    "forward",
    "logits",
    "sample",
    "runner",
    "post",
    "output",
    "draft",
    "context",
)
DEVICE_PHASES = ("forward", "logits", "draft", "context")


class PhaseTimer:
    """Seconds spent inside wrapped callables, by phase; nested phases are
    subtracted from the phase around them, so the phases add up to the step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # child time of each open phase

    def wrap(self, phase: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                children = self._stack.pop()
                self.seconds[phase] += spent - children
                if self._stack:
                    self._stack[-1] += spent

        return timed

    def reset(self) -> None:
        self.seconds.clear()


def instrument(engine: LLMEngine, timer: PhaseTimer) -> None:
    """Wrap the engine's phase functions (this engine's objects, and the runner
    module's reference to build_step, only)."""
    runner = engine.workers.runner
    scheduler = engine.scheduler
    scheduler.schedule = timer.wrap("schedule", scheduler.schedule)
    scheduler.postprocess = timer.wrap("post", scheduler.postprocess)
    runner.execute = timer.wrap("runner", runner.execute)
    runner._sample_and_draft = timer.wrap("sample", runner._sample_and_draft)
    runner.finish = timer.wrap("sample", runner.finish)
    runner.model.forward = timer.wrap("forward", runner.model.forward)
    runner.model.compute_logits = timer.wrap("logits", runner.model.compute_logits)
    engine._output_of = timer.wrap("output", engine._output_of)
    drafter = runner.drafter
    if drafter is not None:
        drafter.propose = timer.wrap("draft", drafter.propose)
        drafter.precompute_context_kv = timer.wrap(
            "context", drafter.precompute_context_kv
        )
    inputs = model_runner_module.prepare_inputs
    model_runner_module.prepare_inputs = timer.wrap("inputs", inputs)


def uninstrument() -> None:
    inputs = model_runner_module.prepare_inputs
    model_runner_module.prepare_inputs = getattr(inputs, "__wrapped__", inputs)


def start_decode(
    engine: LLMEngine,
    batch: int,
    steps: int,
    seed: int,
    input_len: int,
    stream: bool = False,
) -> None:
    """Add `batch` requests of `input_len` prompt tokens and `steps` + 1 output
    tokens and step until every one holds its first token: what follows are
    decode steps only. Final-only requests, as `LLMEngine.generate` adds, unless
    `stream` (a server's streams: an output every step)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100) for _ in range(input_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    add_past_prefill(engine, prompts, params, final_only=not stream)


def add_past_prefill(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    final_only: bool,
) -> None:
    """Add one request per prompt and step until every one holds its first token:
    the engine's next steps are decode steps only."""
    for prompt in prompts:
        engine.add_request(prompt, params, final_only=final_only)
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        seq.num_output_tokens == 0 for seq in scheduler.running
    ):
        engine.step()


def run_to_end(engine: LLMEngine) -> tuple[float, int]:
    """(seconds, steps) until no request is left."""
    count = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        count += 1
    return time.perf_counter() - start, count


def measure(
    engine: LLMEngine,
    timer: PhaseTimer,
    batch: int,
    steps: int,
    seed: int,
    input_len: int,
    stream: bool,
) -> dict[str, float]:
    """Microseconds per decode step: each phase, "engine" (the rest of
    LLMEngine.step), "step" (the whole) and "host" (all but the device phases)."""
    start_decode(engine, batch, steps, seed, input_len, stream)
    timer.reset()
    seconds, count = run_to_end(engine)
    per_step = {p: timer.seconds.get(p, 0.0) / count * 1e6 for p in PHASES}
    per_step["engine"] = seconds / count * 1e6 - sum(per_step.values())
    per_step["step"] = seconds / count * 1e6
    per_step["host"] = per_step["step"] - sum(per_step[p] for p in DEVICE_PHASES)
    return per_step


def report(batch: int, runs: list[dict[str, float]]) -> None:
    """One line per batch size: the minimum over the runs of each figure, since
    other work on the machine only ever adds time."""
    best = {key: min(run[key] for run in runs) for key in runs[0]}
    cells = "  ".join(
        f"{p} {best[p]:.1f}" for p in (*PHASES, "engine") if p not in DEVICE_PHASES
    )
    device = " + ".join(f"{p} {best[p]:.1f}" for p in DEVICE_PHASES if best[p])
    print(
        f"batch {batch:3d}: step {best['step']:8.1f} us, {device} us, "
        f"host {best['host']:7.1f} us/step | {cells}"
    )


@contextlib.contextmanager
def without_forward(engine: LLMEngine):
    """The model's forward returns zeros at once (the tokens are garbage, which
    `ignore_eos` makes harmless); a drafter proposes zeros and writes no context
    rows."""
    runner = engine.workers.runner
    hidden = int(engine.config.hf_config.text["hidden_size"])
    forward = runner.model.forward

    def no_forward(input_ids, positions, intermediate=None):
        return torch.zeros(input_ids.shape[0], hidden, dtype=runner.dtype)

    runner.model.forward = no_forward
    drafter = runner.drafter
    if drafter is not None:
        width = drafter.num_speculative_tokens
        propose, write_context = drafter.propose, drafter.precompute_context_kv

        def no_draft(anchor_ids, anchor_positions, block_tables, sampling):
            return DraftOutput(anchor_ids.new_zeros(anchor_ids.shape[0], width), None)

        drafter.propose = no_draft
        drafter.precompute_context_kv = lambda *args: None
    try:
        yield
    finally:
        runner.model.forward = forward
        if drafter is not None:
            drafter.propose, drafter.precompute_context_kv = propose, write_context


def profile_host(
    engine: LLMEngine, batch: int, steps: int, top: int, input_len: int, stream: bool
) -> None:
    """cProfile of decode steps without a forward: the host's functions only."""
    start_decode(engine, batch, steps, 1, input_len, stream)
    with without_forward(engine):
        profiler = cProfile.Profile()
        profiler.enable()
        seconds, count = run_to_end(engine)
        profiler.disable()
    print(
        f"\n## cProfile, batch {batch}, {count} decode steps without a forward: "
        f"{seconds / count * 1e6:.1f} us/step (profiled), most own time"
    )
    stats = pstats.Stats(profiler).sort_stats("tottime")
    stats.print_stats(top)


def time_replay_buffer(batch: int, table_width: int, block_size: int = 16) -> None:
    """The step buffer of a graph replay (`StepGraphs.run`): decode rows, tables
    padded to the graph's fixed width, built on the host every decode step."""
    works = [
        SeqWork(
            seq_id=i,
            token_ids=[5],
            context_len=40,
            block_table=list(range(8)),
            state_slot=i,
        )
        for i in range(batch)
    ]
    padding = SeqPadding(batch, 0, 0)
    runs = timeit.repeat(
        lambda: build_step(works, block_size, table_width, padding),
        number=500,
        repeat=5,
    )
    print(
        f"batch {batch:3d}: graph-replay step buffer (table width {table_width}) "
        f"{min(runs) / 500 * 1e6:.1f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-kimi-k3")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument(
        "--input-len",
        type=int,
        default=16,
        help="prompt tokens (longer prompts: longer block tables per sequence)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument(
        "--no-forward",
        action="store_true",
        help="the forward returns zeros: host phases with warm caches, as on a GPU",
    )
    parser.add_argument(
        "--replay-table-width",
        type=int,
        default=256,
        help="block-table width of the graph-replay buffer timed (256: 4096 tokens)",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="requests stream (an output each step), as a server's do",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="DSpark's draft (e.g. tiny-kimi-k3-dspark): a step verifies and drafts",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="run ahead as on a GPU (run_ahead.py): pending rows filled and repaired",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    torch.manual_seed(args.seed)
    speculation = {}
    if args.draft_model:
        speculation = dict(
            method="dspark",
            draft_model=args.draft_model,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    engine = LLMEngine(
        args.model,
        device="cpu",
        max_num_seqs=max(batches),
        # Room for a verify's drafts past the last output token.
        max_model_len=args.input_len + 48 + args.steps + args.num_speculative_tokens,
        max_num_batched_tokens=max(256, args.input_len * max(batches)),
        async_scheduling=args.async_scheduling,
        **speculation,
    )
    timer = PhaseTimer()
    with contextlib.ExitStack() as stack:
        if args.no_forward:  # before instrument, so the timer wraps the stub
            stack.enter_context(without_forward(engine))
        instrument(engine, timer)
        stack.callback(uninstrument)
        for batch in batches:
            case = (args.seed, args.input_len, args.stream)
            measure(engine, timer, batch, 4, *case)  # warm-up
            runs = [
                measure(engine, timer, batch, args.steps, *case)
                for _ in range(args.repeats)
            ]
            report(batch, runs)
    for batch in batches:
        time_replay_buffer(batch, args.replay_table_width)
    for batch in batches if args.cprofile else []:
        profile_host(
            engine, batch, args.steps, args.cprofile, args.input_len, args.stream
        )
    engine.close()


if __name__ == "__main__":
    main()
