"""What the accuracy gate reads from a server log and from /debug/mtp_stats.

- Acceptance: the last cumulative `[MTP Stats         ]` line (ROCm/ATOM's wording,
  which atom keeps), never the `[MTP Stats Interval]` ones; its rate is a percent.
  /debug/mtp_stats gives the same counters as a JSON object with a fraction.
- Start-up markers: one `[PPAuxRelay]` line per TP rank of every stage that arms
  taps for the relay, one `[KDA rollback]` line per rank that rolls KDA state back
  (atom/model_engine/model_runner.py logs both).
- Missing-weight warnings: atom's loader refuses a checkpoint that leaves a
  parameter unloaded, so any such line means something else is wrong.
- P/D fallbacks: a consumer that could not receive a request's KV logs that it
  prefills the request itself (atom/model_engine/scheduler.py); a P/D run must
  have none, or it measured aggregated serving.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MTP_LINE = re.compile(r"\[MTP Stats(?P<label>[^\]]*)\]")
MTP_FIELDS = re.compile(
    r"Average toks/fwd: (?P<tpf>[\d.]+).*?"
    r"Accepted/Total Draft tokens: (?P<accepted>\d+)/(?P<drafted>\d+).*?"
    r"Acceptance rate: (?P<rate>[\d.]+)%"
)
MARKERS = {"relay": "[PPAuxRelay]", "kda_rollback": "[KDA rollback]"}
PD_FALLBACK = "falling back to prefill"
MISSING_WEIGHT = re.compile(
    r"\bmissing[ _-]?(weights?|param\w*|tensors?|keys?)\b"
    r"|\b(weights?|param\w*|tensors?)\b[^\n]{0,80}\b(not|never) "
    r"(loaded|initiali[sz]ed|found in the checkpoint)\b"
    r"|\bnot initiali[sz]ed from the (model )?checkpoint\b",
    re.IGNORECASE,
)
# A percent and the count ratio may differ by the line's rounding (2 decimals).
PERCENT_ROUNDING = 0.00005 + 1e-9


class LogError(ValueError):
    pass


@dataclass(frozen=True)
class Acceptance:
    """Speculation counters; `rate` is a fraction."""

    rate: float
    accepted: int
    drafted: int
    tokens_per_forward: float
    source: str


@dataclass
class LogScan:
    markers: dict[str, list[str]] = field(default_factory=dict)
    missing_weight_lines: list[str] = field(default_factory=list)
    pd_fallback_lines: list[str] = field(default_factory=list)
    mtp_lines: int = 0
    interval_lines: int = 0
    acceptance: Acceptance | None = None

    def marker_counts(self) -> dict[str, int]:
        return {name: len(lines) for name, lines in self.markers.items()}


def parse_mtp_line(line: str) -> Acceptance:
    """One `[MTP Stats ...]` line -> counters (the percent becomes a fraction)."""
    found = MTP_FIELDS.search(line)
    if found is None:
        raise LogError(f"unreadable MTP stats line: {line.strip()!r}")
    accepted, drafted = int(found["accepted"]), int(found["drafted"])
    percent = float(found["rate"])
    if not 0.0 <= percent <= 100.0:
        raise LogError(f"acceptance rate {percent}% outside [0, 100]: {line.strip()!r}")
    if accepted > drafted:
        raise LogError(f"more accepted than drafted tokens: {line.strip()!r}")
    rate = percent / 100.0
    if drafted and abs(rate - accepted / drafted) > PERCENT_ROUNDING:
        raise LogError(
            f"acceptance rate {percent}% disagrees with {accepted}/{drafted}: "
            f"{line.strip()!r}"
        )
    return Acceptance(rate, accepted, drafted, float(found["tpf"]), "server log")


def scan_log(text: str) -> LogScan:
    """Markers, missing-weight and P/D fallback lines and the last cumulative MTP
    line of a log."""
    scan = LogScan(markers={name: [] for name in MARKERS})
    last_cumulative = None
    for line in text.splitlines():
        for name, marker in MARKERS.items():
            if marker in line:
                scan.markers[name].append(line)
        if MISSING_WEIGHT.search(line):
            scan.missing_weight_lines.append(line)
        if PD_FALLBACK in line:
            scan.pd_fallback_lines.append(line)
        mtp = MTP_LINE.search(line)
        if mtp is None:
            continue
        if mtp["label"].strip() == "Interval":
            scan.interval_lines += 1
        elif not mtp["label"].strip():
            scan.mtp_lines += 1
            last_cumulative = line
    if last_cumulative is not None:
        scan.acceptance = parse_mtp_line(last_cumulative)
    return scan


def acceptance_from_stats(stats: dict[str, Any]) -> Acceptance | None:
    """The /debug/mtp_stats body -> counters; None when speculation is off.

    The rate comes from the token counts; a reported `acceptance_rate` above 1 is
    read as a percent, and either way it must agree with them.
    """
    if stats.get("enabled") is False:
        return None
    try:
        accepted = int(stats["total_accepted_tokens"])
        drafted = int(stats["total_draft_tokens"])
        tokens_per_forward = float(stats["avg_tokens_per_forward"])
    except (KeyError, TypeError, ValueError) as error:
        raise LogError(f"/debug/mtp_stats lacks a counter: {error}") from None
    if not 0 <= accepted <= drafted:
        raise LogError(f"/debug/mtp_stats: accepted {accepted} of {drafted} drafted")
    rate = accepted / drafted if drafted else 0.0
    reported = stats.get("acceptance_rate")
    if reported is not None:
        reported = float(reported) / 100.0 if reported > 1.0 else float(reported)
        if abs(reported - rate) > PERCENT_ROUNDING:
            raise LogError(
                f"/debug/mtp_stats acceptance_rate {stats['acceptance_rate']} "
                f"disagrees with {accepted}/{drafted}"
            )
    return Acceptance(rate, accepted, drafted, tokens_per_forward, "/debug/mtp_stats")


def read_stats_file(path: str | Path) -> dict[str, Any]:
    try:
        stats = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise LogError(f"cannot read /debug/mtp_stats output {path}: {error}") from None
    if not isinstance(stats, dict):
        raise LogError(f"{path}: expected a JSON object")
    return stats
