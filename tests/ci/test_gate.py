"""scripts/ci/gate.py on committed lm-eval results and server-log excerpts: the
passing case, each failure, the threshold boundaries, percent vs fraction and the
CPU job's own gates (chance level, identical scores, the recorded acceptance)."""

import json
import shutil
from pathlib import Path

import pytest

from scripts.ci import gate

DATA = Path(__file__).parent / "data"
PP2 = "Kimi-K3 DSpark PP2"


def cumulative_line(accepted: int, drafted: int, steps: int) -> str:
    return (
        f"INFO [MTP Stats         ] Average toks/fwd: {1 + accepted / steps:.2f}, "
        f"Accepted/Total Draft tokens: {accepted}/{drafted}, Acceptance rate: "
        f"{100 * accepted / drafted:.2f}%, Accepted tokens distribution: {{}}\n"
    )


def pp2_log(tmp_path: Path, mtp_line: str, relay: int = 4, kda: int = 8) -> Path:
    """A pp2 x tp4 start-up in atom's wording, then one MTP line."""
    lines = [
        f"INFO:atom.model_engine.model_runner:[PPAuxRelay] pp_rank 0 tp_rank {r}: "
        "layers 0:47, capturing taps [2, 23], receiving [], sending [2, 23]\n"
        for r in range(relay)
    ]
    lines += [
        f"INFO:atom.model_engine.model_runner:[KDA rollback] pp_rank {r // 4} "
        f"tp_rank {r % 4}: per-row snapshots of 35 KDA layers, 8 rows per state slot\n"
        for r in range(kda)
    ]
    path = tmp_path / "server.log"
    path.write_text("".join(lines) + mtp_line)
    return path


def results_with(tmp_path: Path, source: str, **changes) -> Path:
    """A copy of a committed results JSON with some numbers changed."""
    data = json.loads((DATA / source).read_text())
    task = next(iter(data["results"]))
    for key, value in changes.items():
        if key == "num_fewshot":
            data["configs"][task]["num_fewshot"] = value
        elif key == "effective":
            data["n-samples"][task]["effective"] = value
        elif key == "chance_level":
            data["configs"][task]["metadata"].pop("chance_level")
        else:
            data["results"][task][key.replace("__", ",")] = value
    folder = tmp_path / f"results-{len(list(tmp_path.iterdir()))}" / "model"
    folder.mkdir(parents=True)
    path = folder / "results_2026-12-01T00-00-00.json"
    path.write_text(json.dumps(data))
    return path.parent.parent


def run_gate(tmp_path: Path, *args: str) -> tuple[int, dict]:
    summary = tmp_path / "gate.json"
    code = gate.main([*args, "--summary", str(summary)])
    return code, json.loads(summary.read_text()) if summary.exists() else {}


def failed(summary: dict) -> list[str]:
    return [c["name"] for c in summary["checks"] if not c["passed"]]


def test_pp2_entry_passes_on_the_upstream_figures(tmp_path):
    log = pp2_log(tmp_path, cumulative_line(7504, 14000, 2000))
    code, summary = run_gate(
        tmp_path, "--entry", PP2, "--results", str(DATA / "gsm8k_results.json"),
        "--server-log", str(log),
    )  # fmt: skip
    assert code == 0, summary
    assert summary["passed"] and failed(summary) == []
    assert {c["name"] for c in summary["checks"]} >= {
        "accuracy", "num_fewshot", "samples", "acceptance", "missing weights",
        "marker relay", "marker kda_rollback",
    }  # fmt: skip
    assert summary["atom_ci_metadata"]["mtp_acceptance_rate"] == pytest.approx(53.6)
    assert summary["atom_ci_metadata"]["avg_tokens_per_forward"] == pytest.approx(4.75)
    assert summary["result"]["other_metrics"] == {
        "exact_match,strict-match": pytest.approx(0.9719, abs=1e-4)
    }
    names = [point["name"] for point in summary["dashboard"]]
    assert names == [
        f"atom::{PP2} accuracy (gsm8k)",
        f"atom::{PP2} MTP acceptance (%)",
    ]


@pytest.mark.parametrize("score, passes", [(0.94, True), (0.9399, False)])
def test_accuracy_threshold_boundary(tmp_path, score, passes):
    results = results_with(
        tmp_path, "gsm8k_results.json", **{"exact_match__flexible-extract": score}
    )
    log = pp2_log(tmp_path, cumulative_line(7504, 14000, 2000))
    code, summary = run_gate(
        tmp_path, "--entry", PP2, "--results", str(results), "--server-log", str(log)
    )
    assert (code == 0) == passes
    assert ("accuracy" in failed(summary)) != passes


@pytest.mark.parametrize("accepted, passes", [(3500, True), (3499, False)])
def test_acceptance_threshold_boundary(tmp_path, accepted, passes):
    # 3500/7000 is exactly 50.00 %, the entry's acceptance_min of 0.50.
    log = pp2_log(tmp_path, cumulative_line(accepted, 7000, 1000))
    code, summary = run_gate(
        tmp_path, "--entry", PP2, "--results", str(DATA / "gsm8k_results.json"),
        "--server-log", str(log),
    )  # fmt: skip
    assert (code == 0) == passes
    assert ("acceptance" in failed(summary)) != passes


def test_last_cumulative_line_is_used_not_the_interval_line(tmp_path):
    log = DATA / "interval_and_cumulative.log"
    code, summary = run_gate(
        tmp_path, "--results", str(DATA / "gsm8k_results.json"),
        "--acceptance-min", "0.536", "--server-log", str(log),
    )  # fmt: skip
    assert code == 0
    assert summary["acceptance"]["rate"] == pytest.approx(0.536)


def test_a_log_with_only_interval_lines_fails_the_acceptance_gate(tmp_path):
    text = (DATA / "interval_and_cumulative.log").read_text().splitlines()
    log = tmp_path / "interval.log"
    log.write_text("\n".join(line for line in text if "Interval" in line))
    code, summary = run_gate(
        tmp_path, "--results", str(DATA / "gsm8k_results.json"),
        "--acceptance-min", "0.5", "--server-log", str(log),
    )  # fmt: skip
    assert code == 1 and failed(summary) == ["acceptance"]
    assert "3 Interval lines" in summary["checks"][0]["detail"]


def test_a_missing_mtp_line_fails(tmp_path):
    log = pp2_log(tmp_path, "INFO engine ready\n")
    code, summary = run_gate(
        tmp_path, "--entry", PP2, "--results", str(DATA / "gsm8k_results.json"),
        "--server-log", str(log),
    )  # fmt: skip
    assert code == 1 and failed(summary) == ["acceptance"]


def test_speculation_off_in_mtp_stats_fails_an_acceptance_gate(tmp_path):
    stats = tmp_path / "mtp_stats.json"
    stats.write_text('{"enabled": false}')
    log = pp2_log(tmp_path, cumulative_line(7504, 14000, 2000))
    code, summary = run_gate(
        tmp_path, "--entry", PP2, "--results", str(DATA / "gsm8k_results.json"),
        "--server-log", str(log), "--mtp-stats", str(stats),
    )  # fmt: skip
    assert code == 1 and failed(summary) == ["acceptance"]


def test_mtp_stats_is_preferred_over_the_log(tmp_path):
    log = pp2_log(tmp_path, cumulative_line(3000, 7000, 1000))  # 42.86 %
    code, summary = run_gate(
        tmp_path, "--entry", PP2, "--results", str(DATA / "gsm8k_results.json"),
        "--server-log", str(log), "--mtp-stats", str(DATA / "mtp_stats_pp2_tp4.json"),
    )  # fmt: skip
    assert code == 0
    assert summary["acceptance"]["source"] == "/debug/mtp_stats"


def test_a_missing_weight_warning_fails(tmp_path):
    code, summary = run_gate(
        tmp_path, "--results", str(DATA / "gsm8k_results.json"),
        "--server-log", str(DATA / "missing_weights.log"),
    )  # fmt: skip
    assert code == 1 and failed(summary) == ["missing weights"]


@pytest.mark.parametrize("relay, kda", [(3, 8), (4, 7), (0, 0)])
def test_wrong_marker_counts_fail(tmp_path, relay, kda):
    log = pp2_log(tmp_path, cumulative_line(7504, 14000, 2000), relay, kda)
    code, summary = run_gate(
        tmp_path, "--entry", PP2, "--results", str(DATA / "gsm8k_results.json"),
        "--server-log", str(log),
    )  # fmt: skip
    assert code == 1
    expected = {"marker relay"} if relay != 4 else set()
    expected |= {"marker kda_rollback"} if kda != 8 else set()
    assert set(failed(summary)) == expected


def test_markers_without_a_log_fail(tmp_path):
    code, summary = run_gate(
        tmp_path, "--entry", "Kimi-K3", "--results", str(DATA / "gsm8k_results.json")
    )
    assert code == 1 and failed(summary) == ["markers"]


def test_a_limited_or_five_shot_run_fails(tmp_path):
    results = results_with(tmp_path, "gsm8k_results.json", num_fewshot=5, effective=50)
    code, summary = run_gate(
        tmp_path, "--entry", "Kimi-K3", "--results", str(results),
        "--server-log", str(pp2_log(tmp_path, "", relay=0, kda=0)),
    )  # fmt: skip
    assert code == 1 and set(failed(summary)) == {"num_fewshot", "samples"}


def test_a_percent_threshold_is_refused(tmp_path, capsys):
    code, _ = run_gate(
        tmp_path, "--results", str(DATA / "gsm8k_results.json"),
        "--acceptance-min", "50",
    )  # fmt: skip
    assert code == 2
    assert "a fraction" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--results", "nowhere"], "no lm-eval results"),
        (["--results", str(DATA / "gsm8k_results.json"), "--task", "mmlu"], "mmlu"),
        (["--results", str(DATA / "gsm8k_results.json"), "--entry", "nope"], "nope"),
    ],
)
def test_unusable_inputs_exit_2(tmp_path, capsys, args, message):
    code, _ = run_gate(tmp_path, *args)
    assert code == 2
    assert message in capsys.readouterr().err


def test_an_inconsistent_mtp_line_is_refused(tmp_path, capsys):
    line = cumulative_line(7504, 14000, 2000).replace("53.60%", "63.60%")
    code, _ = run_gate(
        tmp_path, "--results", str(DATA / "gsm8k_results.json"),
        "--server-log", str(pp2_log(tmp_path, line)),
    )  # fmt: skip
    assert code == 2 and "disagrees" in capsys.readouterr().err


# ---- the CPU job's gates ----

KJV = ["--task", "kjv_next_word", "--metric", "exact_match,first-word"]


def test_score_over_chance_uses_the_task_chance_level(tmp_path):
    code, summary = run_gate(
        tmp_path, *KJV, "--results", str(DATA / "kjv_next_word_results.json"),
        "--min-over-chance", "2",
    )  # fmt: skip
    assert code == 0, summary
    code, summary = run_gate(
        tmp_path, *KJV, "--results", str(DATA / "kjv_next_word_results.json"),
        "--min-over-chance", "3",
    )  # fmt: skip
    assert code == 1 and failed(summary) == ["over chance"]
    no_chance = results_with(tmp_path, "kjv_next_word_results.json", chance_level=None)
    code, summary = run_gate(
        tmp_path, *KJV, "--results", str(no_chance), "--min-over-chance", "2"
    )
    assert code == 1 and "states no chance_level" in summary["checks"][0]["detail"]


def test_speculation_must_score_exactly_the_same(tmp_path):
    reference = DATA / "kjv_next_word_results.json"
    same = results_with(tmp_path, "kjv_next_word_results.json")
    code, summary = run_gate(
        tmp_path, *KJV, "--results", str(same), "--same-score-as", str(reference)
    )
    assert code == 0, summary
    score = json.loads(reference.read_text())["results"]["kjv_next_word"]
    other = results_with(
        tmp_path,
        "kjv_next_word_results.json",
        **{"exact_match__first-word": score["exact_match,first-word"] + 1 / 288},
    )
    code, summary = run_gate(
        tmp_path, *KJV, "--results", str(other), "--same-score-as", str(reference)
    )
    assert code == 1 and failed(summary) == ["same score"]


def test_identical_generations_are_counted_from_lm_eval_samples(tmp_path):
    runs = []
    for name, responses in (("a", ["x", "y", "z"]), ("b", ["x", "y", "w"])):
        folder = tmp_path / name / "model"
        folder.mkdir(parents=True)
        shutil.copy(DATA / "kjv_next_word_results.json", folder / "results_1.json")
        (folder / "samples_kjv_next_word_1.jsonl").write_text(
            "".join(
                json.dumps({"doc_id": i, "resps": [[r]]}) + "\n"
                for i, r in enumerate(responses)
            )
        )
        runs.append(tmp_path / name)
    code, summary = run_gate(
        tmp_path, *KJV, "--results", str(runs[1]), "--same-score-as", str(runs[0])
    )
    assert code == 0 and summary["identical_generations"] == "2/3"


def test_recorded_acceptance_applies_only_to_the_weights_it_names(tmp_path):
    reference = Path(gate.REPO_ROOT) / ".github" / "accuracy" / "tiny_reference.json"
    threshold, rule = gate.reference_acceptance(reference)
    recorded = json.loads(reference.read_text())
    assert threshold == pytest.approx(recorded["acceptance_rate"] - 0.02)
    assert recorded["tolerance"] == 0.02 and "tiny_reference.json" in rule
    stale = tmp_path / "stale.json"
    first = next(iter(recorded["weights_sha256"]))
    recorded["weights_sha256"][first] = "0" * 64
    stale.write_text(json.dumps(recorded))
    with pytest.raises(gate.GateInputError, match="other weights"):
        gate.reference_acceptance(stale)


PD = "Kimi-K3 DSpark PP2 P/D"
FALLBACK = (
    "WARNING atom.model_engine.scheduler: KV receive failed for request 7: "
    "producer unreachable; falling back to prefill\n"
)


def pd_logs(tmp_path: Path, consumer_tail: str = "") -> tuple[Path, Path]:
    """A pp2 x tp4 producer's start-up and a tp4 consumer's, with its MTP line."""
    producer = pp2_log(tmp_path, "").rename(tmp_path / "producer.log")
    mtp = cumulative_line(7504, 14000, 2000)
    consumer = pp2_log(tmp_path, mtp + consumer_tail, relay=0, kda=4)
    return consumer, producer


def run_pd_gate(tmp_path: Path, *logs: str) -> tuple[int, dict]:
    return run_gate(
        tmp_path, "--entry", PD, "--results", str(DATA / "gsm8k_results.json"), *logs
    )


def test_a_pd_entry_gates_the_consumer_the_producer_and_fallbacks(tmp_path):
    consumer, producer = pd_logs(tmp_path)
    code, summary = run_pd_gate(
        tmp_path, "--server-log", str(consumer), "--producer-log", str(producer)
    )
    assert code == 0, summary
    assert {c["name"] for c in summary["checks"]} >= {
        "acceptance", "marker relay", "marker kda_rollback", "producer missing weights",
        "producer marker relay", "producer marker kda_rollback", "P/D fallbacks",
    }  # fmt: skip
    assert summary["markers"] == {"relay": 0, "kda_rollback": 4}
    assert summary["producer_markers"] == {"relay": 4, "kda_rollback": 8}
    assert summary["pd_fallbacks"] == 0


def test_a_pd_request_that_fell_back_to_local_prefill_fails(tmp_path):
    consumer, producer = pd_logs(tmp_path, FALLBACK)
    code, summary = run_pd_gate(
        tmp_path, "--server-log", str(consumer), "--producer-log", str(producer)
    )
    assert code == 1 and failed(summary) == ["P/D fallbacks"]
    assert "producer unreachable" in summary["checks"][-1]["detail"]


def test_a_pd_entry_needs_the_producer_log_with_its_own_markers(tmp_path):
    consumer, producer = pd_logs(tmp_path)
    code, summary = run_pd_gate(tmp_path, "--server-log", str(consumer))
    assert code == 1 and failed(summary) == ["producer markers"]
    swapped = ["--server-log", str(producer), "--producer-log", str(consumer)]
    code, summary = run_pd_gate(tmp_path, *swapped)
    assert code == 1
    assert {"producer marker relay", "marker relay"} <= set(failed(summary))


def test_no_pd_fallback_applies_to_any_run(tmp_path):
    log = pp2_log(tmp_path, cumulative_line(7504, 14000, 2000) + FALLBACK)
    args = ["--entry", PP2, "--results", str(DATA / "gsm8k_results.json")]
    code, _ = run_gate(tmp_path, *args, "--server-log", str(log))
    assert code == 0  # an aggregated entry has no P/D requests to count
    code, summary = run_gate(
        tmp_path, *args, "--server-log", str(log), "--no-pd-fallback"
    )
    assert code == 1 and failed(summary) == ["P/D fallbacks"]
