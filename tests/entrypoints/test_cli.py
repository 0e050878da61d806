"""The `atom` command end to end on the tiny checkpoints: `atom generate`, its
errors, `--version`, `--help` and Ctrl-C."""

import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from tests.entrypoints.server_helpers import Server
from tests.process_helpers import descendant_pids, survivors

REPO_ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "atom.entrypoints.cli"]
# Generous: a loaded 2-core machine starts two rank processes slowly.
START_DEADLINE_S = 300
EXIT_DEADLINE_S = 120


def atom_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180
    )


def generate_process(*flags: str) -> subprocess.CompletedProcess:
    return atom_process("generate", *flags)


def run_generate(*flags: str) -> str:
    done = generate_process(*flags)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_generate_prints_each_prompt_and_completion_greedily():
    out = run_generate("--max-tokens", "4", "--device", "cpu")
    lines = out.splitlines()
    prompts = [line for line in lines if line.startswith("Prompt: ")]
    completions = [line for line in lines if line.startswith("Completion: ")]
    assert prompts == [
        "Prompt: 'And God said unto Noah,'",
        "Prompt: 'The LORD is my shepherd;'",
        "Prompt: 'And Jesus answered and said unto them,'",
    ]
    assert len(completions) == 3
    # The trained tiny target answers in words of its corpus.
    words = " ".join(line.split(":", 1)[1] for line in completions)
    assert sum(w in words for w in ("the", "and", "LORD", "unto", "of")) >= 2
    assert "tok/s" in lines[-1]
    assert "[MTP Stats" not in out
    # Greedy by default: a second run completes every prompt the same way.
    again = run_generate("--max-tokens", "4", "--device", "cpu").splitlines()
    assert [line for line in again if line.startswith("Completion: ")] == completions


def test_generate_reads_prompts_from_a_file(tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("first prompt\n\nsecond_prompt\n")
    out = run_generate(
        "--prompts_file", str(prompts_file), "--max_tokens", "3", "--device", "cpu"
    )
    assert "Prompt: 'first prompt'" in out and "Prompt: 'second_prompt'" in out
    assert out.count("Completion: ") == 2


def test_generate_with_dspark_reports_acceptance():
    out = run_generate(
        "--method",
        "dspark",
        "--num-speculative-tokens",
        "3",
        "--max-tokens",
        "8",
        "--device",
        "cpu",
    )
    assert out.count("Completion: ") == 3
    assert "[MTP Stats" in out


def test_bad_sampling_values_are_clean_errors():
    for flags, message in [
        (["--seed", str(10**23)], "--seed: expected an integer in [0, 2**63 - 1]"),
        (["--seed", "1e23"], "--seed: expected an integer"),
        (["--top-k", "0"], "top_k must be -1 (off) or >= 1"),
    ]:
        done = generate_process(*flags)
        assert done.returncode != 0 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--prompt", ""], "--prompt is empty"),
        (["generate", "--prompts-file", "/no/such/prompts.txt"], "--prompts-file:"),
        (
            ["generate", "--model", "no-such-model"],
            "model 'no-such-model' is neither a folder containing config.json",
        ),
        (["generate", "-tp", "3"], "tensor_parallel_size=3 does not divide"),
        (["serve", "-pp", "100"], "pipeline_parallel_size=100 exceeds"),
        # Refused by the engine for the request, while generating.
        (
            ["generate", "--skip-tokenizer-init", "--prompt", "99999999"],
            "prompt token ids must lie in",
        ),
        (
            ["generate", "--max-model-len", "64", "--max-tokens", "5000"],
            "max_tokens=5000 = ",
        ),
        (
            ["generate", "--max-model-len", "16", "--prompt", "and the LORD " * 20],
            "exceeds max_model_len=16",
        ),
    ],
)
def test_user_mistakes_are_one_line_errors(args, message):
    done = atom_process(*args, "--device", "cpu")
    command = args[0]
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"atom {command}: error: ") and message in last, last


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--method", "eagle3"], "argument --method: invalid choice"),
        (["serve", "--port", "8000"], "--port is not supported by atom"),
        ([], "the following arguments are required: command"),
    ],
)
def test_bad_flags_are_one_line_not_the_usage(args, message):
    done = atom_process(*args)
    assert done.returncode == 2
    prog = " ".join(["atom", *args[:1]])
    assert done.stderr.startswith(f"{prog}: error: {message}"), done.stderr
    assert (
        done.stderr.endswith(f"(see {prog} --help)\n") and done.stderr.count("\n") == 1
    )


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--num-speculative-tokens", "100"],
        # Refused in a rank process, which hands the message to the engine.
        ["generate", "-pp", "2", "--num-speculative-tokens", "400"],
        ["serve", "-pp", "2", "--num-speculative-tokens", "400"],
    ],
)
def test_too_many_drafts_name_the_bound(args):
    done = atom_process(*args, "--method", "dspark", "--device", "cpu")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    drafts = args[-1]
    assert last.startswith(f"atom {args[0]}: error: "), last
    assert f"num_speculative_tokens={drafts} (--num-speculative-tokens) is too " in last
    assert "at most" in last and "draft tokens fit" in last, last


def test_version_is_the_package_version():
    done = atom_process("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"atom {metadata.version('atom')}\n"


# Runs `atom ARGS` in-process and prints which heavy modules it imported.
IMPORTS_PROBE = """
import sys
from atom.entrypoints.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
print("heavy:", [m for m in ("torch", "transformers") if m in sys.modules])
"""


@pytest.mark.parametrize(
    "args", [["--help"], ["generate", "--help"], ["serve", "--help"], ["--version"]]
)
def test_help_imports_no_torch(args):
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_PROBE, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "heavy: []", done.stdout[-500:]


def wait_for_log(process: subprocess.Popen, log_path: Path, text: str, count: int):
    deadline = time.monotonic() + START_DEADLINE_S
    while log_path.read_text(errors="replace").count(text) < count:
        assert process.poll() is None, log_path.read_text(errors="replace")
        assert time.monotonic() < deadline, log_path.read_text(errors="replace")
        time.sleep(0.5)


@pytest.mark.slow
def test_ctrl_c_ends_generate_with_status_0_and_no_ranks(tmp_path):
    log_path = tmp_path / "generate.log"
    flags = ["--device", "cpu", "-pp", "2", "--max-tokens", "3000"]
    with open(log_path, "w") as log:
        # Its own process group, so that the signal reaches the ranks too, as a
        # terminal's Ctrl-C does.
        process = subprocess.Popen(
            [*CLI, "generate", *flags],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # Each rank logs its memory ledger once its model is loaded.
        wait_for_log(process, log_path, "[memory ledger", count=2)
        ranks = descendant_pids(process.pid)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=EXIT_DEADLINE_S) == 0, log_path.read_text()
        assert "Traceback" not in log_path.read_text()
        assert survivors(ranks, deadline_s=EXIT_DEADLINE_S) == []
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.slow
def test_ctrl_c_ends_serve_with_status_0_and_no_ranks(tmp_path):
    server = Server(
        ["-pp", "2"],
        tmp_path / "serve.log",
        entrypoint=("atom.entrypoints.cli", "serve"),
    ).wait_healthy()
    try:
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=EXIT_DEADLINE_S) == 0, server.log()
        assert "Traceback" not in server.log()
        assert survivors(server.descendants, deadline_s=EXIT_DEADLINE_S) == []
    finally:
        server.stop()
