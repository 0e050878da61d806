"""Pass or fail one accuracy run: lm-eval's results plus what the server logged.

  python -m scripts.ci.gate --entry "Kimi-K3 DSpark PP2" --results out/lm_eval \
      --server-log out/server.log --mtp-stats out/mtp_stats.json --summary out/gate.json

`--entry` takes the thresholds and expected marker counts from the catalog
(scripts/ci/catalog.py) and ROCm/ATOM's GSM8K expectations (3-shot, all 1319
problems, gated on `exact_match,flexible-extract`); explicit flags override them,
and without `--entry` only the given checks run. For a P/D entry the server log is
the consumer's, `--producer-log` the producer's (its own markers, no missing
weights), and no request may have fallen back to a local prefill. Acceptance comes from the
/debug/mtp_stats body when given, else from the log's last cumulative
`[MTP Stats` line; thresholds are fractions. Exit 0 when every check passes, 1
when one fails, 2 when an input is unusable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scripts.ci.catalog import DEFAULT_CATALOG, CatalogError, find_entry, load_catalog
from scripts.ci.server_log import (
    MARKERS,
    Acceptance,
    LogError,
    LogScan,
    acceptance_from_stats,
    read_stats_file,
    scan_log,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
GSM8K_TASK = "gsm8k"
GSM8K_METRIC = "exact_match,flexible-extract"
GSM8K_FEWSHOT = 3
GSM8K_TEST_SIZE = 1319
# Floating-point slack for "value >= threshold" (thresholds have few decimals).
EPSILON = 1e-9


class GateInputError(ValueError):
    pass


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class EvalResult:
    """One task's numbers from an lm-eval results JSON."""

    path: str
    task: str
    metric: str
    score: float
    stderr: float | None
    other_metrics: dict[str, float]
    num_fewshot: int | None
    samples: int | None
    chance_level: float | None


def find_results_file(path: str | Path) -> Path:
    """A results JSON, or the newest `results_*.json` under a folder (lm-eval
    writes `<output_path>/<model>/results_<timestamp>.json`)."""
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.rglob("results_*.json"), key=lambda p: p.name)
    if not found:
        raise GateInputError(f"no lm-eval results_*.json under {path}")
    return found[-1]


def read_eval_result(path: str | Path, task: str, metric: str) -> EvalResult:
    results_file = find_results_file(path)
    try:
        data = json.loads(results_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise GateInputError(f"cannot read {results_file}: {error}") from None
    task_results = data.get("results", {}).get(task)
    if task_results is None:
        tasks = ", ".join(sorted(data.get("results", {}))) or "none"
        raise GateInputError(f"{results_file}: no results for task {task!r} ({tasks})")
    if metric not in task_results:
        keys = ", ".join(k for k in task_results if k != "alias")
        raise GateInputError(
            f"{results_file}: task {task!r} has no metric {metric!r} ({keys})"
        )
    name, _, filter_name = metric.partition(",")
    stderr = task_results.get(f"{name}_stderr,{filter_name}")
    config = data.get("configs", {}).get(task, {})
    metadata = config.get("metadata") or {}
    samples = data.get("n-samples", {}).get(task, {}).get("effective")
    return EvalResult(
        path=str(results_file),
        task=task,
        metric=metric,
        score=float(task_results[metric]),
        stderr=float(stderr) if isinstance(stderr, int | float) else None,
        other_metrics={
            k: float(v)
            for k, v in task_results.items()
            if k != metric and "," in k and "_stderr" not in k
        },
        num_fewshot=config.get("num_fewshot"),
        samples=samples,
        chance_level=metadata.get("chance_level"),
    )


def generations(results_file: str | Path, task: str) -> dict[int, Any]:
    """doc_id -> raw responses, from the `samples_<task>_*.jsonl` beside it."""
    folder = Path(results_file).parent
    files = sorted(folder.glob(f"samples_{task}_*.jsonl"))
    if not files:
        return {}
    out = {}
    for line in files[-1].read_text(encoding="utf-8").splitlines():
        if line.strip():
            sample = json.loads(line)
            out[sample["doc_id"]] = sample.get("resps")
    return out


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def reference_acceptance(path: str | Path) -> tuple[float, str]:
    """(threshold, description) from a recorded-figure JSON such as
    .github/accuracy/tiny_reference.json: its rate minus its tolerance, valid only
    while the weights it names are the ones in the repository."""
    try:
        reference = json.loads(Path(path).read_text(encoding="utf-8"))
        rate = float(reference["acceptance_rate"])
        tolerance = float(reference["tolerance"])
        weights = reference["weights_sha256"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise GateInputError(f"unusable acceptance reference {path}: {error}") from None
    for relative, expected in weights.items():
        file = REPO_ROOT / relative
        if not file.is_file() or sha256_of(file) != expected:
            raise GateInputError(
                f"{path} records acceptance for other weights: {relative} is missing "
                "or changed. Copy the new figure from the training report "
                "(tools/train_tiny.py report.json) and the new sha256 into it."
            )
    return rate - tolerance, f"recorded {rate:.4f} - {tolerance:.2f} ({path})"


def at_least(value: float, threshold: float) -> bool:
    return value >= threshold - EPSILON


@dataclass
class GateSettings:
    name: str
    task: str
    metric: str
    accuracy_min: float | None = None
    num_fewshot: int | None = None
    num_samples: int | None = None
    min_over_chance: float | None = None
    acceptance_min: float | None = None
    acceptance_rule: str = ""
    markers: dict[str, int] | None = None
    same_score_as: str | None = None
    # P/D: the producer's start-up markers, and whether a fallback fails the run.
    producer_markers: dict[str, int] | None = None
    no_pd_fallback: bool = False


def run_checks(
    settings: GateSettings,
    result: EvalResult,
    server_log: str | None,
    stats: dict[str, Any] | None,
    producer_log: str | None = None,
) -> tuple[list[Check], dict[str, Any]]:
    checks: list[Check] = []
    facts: dict[str, Any] = {}

    def check(name: str, passed: bool, detail: str) -> None:
        checks.append(Check(name, bool(passed), detail))

    score = result.score
    if settings.accuracy_min is not None:
        check(
            "accuracy",
            at_least(score, settings.accuracy_min),
            f"{result.metric} {score:.4f} >= {settings.accuracy_min}",
        )
    if settings.num_fewshot is not None:
        check(
            "num_fewshot",
            result.num_fewshot == settings.num_fewshot,
            f"{result.num_fewshot} == {settings.num_fewshot}",
        )
    if settings.num_samples is not None:
        check(
            "samples",
            result.samples == settings.num_samples,
            f"{result.samples} evaluated == {settings.num_samples}",
        )
    if settings.min_over_chance is not None:
        chance = result.chance_level
        if chance is None:
            check("over chance", False, f"task {result.task} states no chance_level")
        else:
            bar = settings.min_over_chance * chance
            check(
                "over chance",
                at_least(score, bar) and score > chance,
                f"{score:.4f} >= {settings.min_over_chance} x chance {chance} = "
                f"{bar:.4f}",
            )
    if settings.same_score_as is not None:
        other = read_eval_result(settings.same_score_as, result.task, result.metric)
        ours, theirs = generations(result.path, result.task), generations(
            other.path, result.task
        )
        same = sum(1 for doc, resp in ours.items() if theirs.get(doc) == resp)
        facts["identical_generations"] = f"{same}/{len(ours)}"
        check(
            "same score",
            score == other.score,
            f"{score:.6f} == {other.score:.6f} of {other.path} "
            f"({same} of {len(ours)} generations identical)",
        )

    acceptance: Acceptance | None = None
    scan = scan_log(server_log) if server_log is not None else None
    if stats is not None:
        acceptance = acceptance_from_stats(stats)
    elif scan is not None:
        acceptance = scan.acceptance
    if acceptance is not None:
        facts["acceptance"] = asdict(acceptance)
    if stats is not None and scan is not None and scan.acceptance is not None:
        facts["log_acceptance"] = asdict(scan.acceptance)  # reported, not gated
    if settings.acceptance_min is not None:
        if acceptance is None:
            interval = f" ({scan.interval_lines} Interval lines)" if scan else ""
            check(
                "acceptance",
                False,
                "no acceptance figure: /debug/mtp_stats reported speculation off, or "
                f"the log has no cumulative [MTP Stats line{interval}",
            )
        else:
            check(
                "acceptance",
                at_least(acceptance.rate, settings.acceptance_min),
                f"{acceptance.rate:.4f} ({acceptance.accepted}/{acceptance.drafted}, "
                f"{acceptance.source}) >= {settings.acceptance_min:.4f}"
                + (
                    f" = {settings.acceptance_rule}" if settings.acceptance_rule else ""
                ),
            )

    def check_log(scan: LogScan, label: str, markers: dict[str, int]) -> None:
        lines = scan.missing_weight_lines
        check(
            f"{label}missing weights",
            not lines,
            f"{len(lines)} missing-weight lines"
            + "".join(f"\n      {line}" for line in lines[:5]),
        )
        for name, expected in markers.items():
            found = len(scan.markers[name])
            check(
                f"{label}marker {name}",
                found == expected,
                f"{found} '{MARKERS[name]}' lines == {expected}",
            )

    if scan is not None:
        facts["markers"] = scan.marker_counts()
        check_log(scan, "", settings.markers or {})
    elif settings.markers:
        check("markers", False, "expected marker counts need --server-log")
    if producer_log is not None:
        producer = scan_log(producer_log)
        facts["producer_markers"] = producer.marker_counts()
        check_log(producer, "producer ", settings.producer_markers or {})
    elif settings.producer_markers:
        check("producer markers", False, "a P/D entry's gate needs --producer-log")
    if settings.no_pd_fallback:
        if scan is None:
            check("P/D fallbacks", False, "counting fallbacks needs --server-log")
        else:
            lines = scan.pd_fallback_lines
            facts["pd_fallbacks"] = len(lines)
            check(
                "P/D fallbacks",
                not lines,
                f"{len(lines)} requests fell back to a local prefill == 0"
                + "".join(f"\n      {line}" for line in lines[:5]),
            )
    return checks, facts


def settings_from_args(args: argparse.Namespace) -> GateSettings:
    entry = None
    if args.entry:
        entry = find_entry(load_catalog(args.catalog), args.entry)
    settings = GateSettings(
        name=args.entry or args.name or args.task or GSM8K_TASK,
        task=args.task or GSM8K_TASK,
        metric=args.metric or GSM8K_METRIC,
    )
    if entry is not None:
        settings.accuracy_min = entry.fields["accuracy_threshold"]
        settings.num_fewshot = GSM8K_FEWSHOT
        settings.num_samples = GSM8K_TEST_SIZE
        settings.acceptance_min = entry.acceptance_min
        settings.markers = entry.log_markers
        settings.producer_markers = entry.producer_log_markers
        settings.no_pd_fallback = entry.pd is not None
    overrides = {
        "accuracy_min": args.accuracy_min,
        "num_fewshot": args.num_fewshot,
        "num_samples": args.num_samples,
        "min_over_chance": args.min_over_chance,
        "acceptance_min": args.acceptance_min,
        "same_score_as": args.same_score_as,
    }
    for key, value in overrides.items():
        if value is not None:
            setattr(settings, key, value)
    if args.acceptance_reference:
        settings.acceptance_min, settings.acceptance_rule = reference_acceptance(
            args.acceptance_reference
        )
    if args.no_pd_fallback:
        settings.no_pd_fallback = True
    if args.expect_marker:
        settings.markers = {**(settings.markers or {}), **dict(args.expect_marker)}
    for what in ("accuracy_min", "acceptance_min"):
        value = getattr(settings, what)
        if value is not None and not 0.0 <= value <= 1.0:
            raise GateInputError(
                f"{what} must be a fraction in [0, 1], got {value} (a percent?)"
            )
    return settings


def _marker(text: str) -> tuple[str, int]:
    name, sep, count = text.partition("=")
    if not sep or name not in MARKERS or not count.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected NAME=COUNT with NAME in {sorted(MARKERS)}, got {text!r}"
        )
    return name, int(count)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--results", required=True, help="results JSON or folder")
    parser.add_argument("--entry", help="catalog entry whose gates apply")
    parser.add_argument("--catalog", default=str(DEFAULT_CATALOG))
    parser.add_argument("--name", help="label for the report (default: the entry)")
    parser.add_argument("--task", help=f"lm-eval task (default {GSM8K_TASK})")
    parser.add_argument("--metric", help=f"gated metric (default {GSM8K_METRIC})")
    parser.add_argument("--accuracy-min", type=float)
    parser.add_argument("--num-fewshot", type=int)
    parser.add_argument("--num-samples", type=int, help="documents evaluated")
    parser.add_argument(
        "--min-over-chance",
        type=float,
        help="score must reach this multiple of the task's metadata.chance_level",
    )
    parser.add_argument("--same-score-as", help="results that must score the same")
    parser.add_argument("--acceptance-min", type=float, help="a fraction")
    parser.add_argument(
        "--acceptance-reference", help="recorded-figure JSON: threshold = rate - tol"
    )
    parser.add_argument("--server-log", help="the server's log (P/D: the consumer's)")
    parser.add_argument("--producer-log", help="a P/D producer's log")
    parser.add_argument(
        "--no-pd-fallback",
        action="store_true",
        help="fail if a P/D request fell back to a local prefill (implied by a P/D "
        "--entry)",
    )
    parser.add_argument("--mtp-stats", help="saved GET /debug/mtp_stats body")
    parser.add_argument(
        "--expect-marker", type=_marker, action="append", help="e.g. relay=4"
    )
    parser.add_argument("--summary", help="write the outcome here as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        result = read_eval_result(args.results, settings.task, settings.metric)
        logs = [
            Path(p).read_text(encoding="utf-8", errors="replace") if p else None
            for p in (args.server_log, args.producer_log)
        ]
        stats = read_stats_file(args.mtp_stats) if args.mtp_stats else None
        checks, facts = run_checks(settings, result, logs[0], stats, logs[1])
    except (GateInputError, LogError, CatalogError, OSError) as error:
        print(f"gate: {error}", file=sys.stderr)
        return 2
    passed = all(c.passed for c in checks)
    print(f"== {settings.name}: {result.task} {result.metric} = {result.score:.4f}")
    for name, value in sorted(result.other_metrics.items()):
        print(f"   {name} = {value:.4f}")
    for key, value in facts.items():
        print(f"   {key}: {value}")
    for c in checks:
        print(f"   [{'PASS' if c.passed else 'FAIL'}] {c.name}: {c.detail}")
    print(f"== {'PASSED' if passed else 'FAILED'}")
    if args.summary:
        write_summary(args.summary, settings, result, facts, checks, passed)
    return 0 if passed else 1


def write_summary(
    path: str,
    settings: GateSettings,
    result: EvalResult,
    facts: dict[str, Any],
    checks: list[Check],
    passed: bool,
) -> None:
    """The outcome, ATOM's `atom_ci_metadata` and dashboard points, as JSON."""
    acceptance = facts.get("acceptance")
    metadata = {"score": result.score, "metric": result.metric}
    dashboard = [
        {
            "name": f"atom::{settings.name} accuracy ({result.task})",
            "unit": "score",
            "value": result.score,
        }
    ]
    if acceptance is not None:
        metadata["mtp_acceptance_rate"] = round(100.0 * acceptance["rate"], 4)
        metadata["avg_tokens_per_forward"] = acceptance["tokens_per_forward"]
        dashboard.append(
            {
                "name": f"atom::{settings.name} MTP acceptance (%)",
                "unit": "%",
                "value": metadata["mtp_acceptance_rate"],
            }
        )
    summary = {
        "name": settings.name,
        "passed": passed,
        "result": asdict(result),
        **facts,
        "atom_ci_metadata": metadata,
        "checks": [asdict(c) for c in checks],
        "dashboard": dashboard,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
