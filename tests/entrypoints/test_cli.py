"""`atom generate` end to end on the tiny checkpoints."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def generate_process(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atom.entrypoints.cli", "generate", *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )


def run_generate(*flags: str) -> str:
    done = generate_process(*flags)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_generate_prints_each_prompt_and_completion():
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


def test_generate_reads_prompts_and_is_greedy_by_default(tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("first prompt\n\nsecond_prompt\n")
    flags = ["--prompts_file", str(prompts_file), "--max_tokens", "3"]
    first = run_generate(*flags, "--device", "cpu")
    assert "Prompt: 'first prompt'" in first and "Prompt: 'second_prompt'" in first
    assert first.count("Completion: ") == 2
    assert run_generate(*flags, "--device", "cpu").splitlines()[:4] == (
        first.splitlines()[:4]
    )


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
