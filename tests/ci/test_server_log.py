"""What the gate reads from server logs and /debug/mtp_stats (scripts/ci/server_log.py),
on committed excerpts: a real atom pp2 x tp4 DSpark log, a log in ROCm/ATOM's
interval + cumulative wording, and lines that report missing weights."""

import json
from pathlib import Path

import pytest

from atom.model_engine.model_runner import KDA_ROLLBACK_MARKER, RELAY_MARKER
from scripts.ci.server_log import (
    MARKERS,
    LogError,
    acceptance_from_stats,
    parse_mtp_line,
    scan_log,
)

DATA = Path(__file__).parent / "data"


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_markers_are_the_engine_wording():
    assert MARKERS == {"relay": RELAY_MARKER, "kda_rollback": KDA_ROLLBACK_MARKER}


def test_atom_pp2_tp4_log_has_4_relay_and_8_rollback_lines_and_a_cumulative_rate():
    scan = scan_log(read("atom_pp2_tp4_dspark.log"))
    assert scan.marker_counts() == {"relay": 4, "kda_rollback": 8}
    assert scan.missing_weight_lines == []
    assert scan.mtp_lines == 1 and scan.interval_lines == 0
    assert (scan.acceptance.accepted, scan.acceptance.drafted) == (52, 71)
    assert scan.acceptance.rate == pytest.approx(0.7324, abs=5e-5)  # from 73.24 %
    assert scan.acceptance.tokens_per_forward == pytest.approx(5.73)


def test_the_last_cumulative_line_wins_over_later_interval_lines():
    scan = scan_log(read("interval_and_cumulative.log"))
    assert (scan.mtp_lines, scan.interval_lines) == (2, 3)
    # The last line of the file is an Interval line at 41 %: it must be ignored.
    assert scan.acceptance.rate == pytest.approx(0.536)
    assert scan.acceptance.tokens_per_forward == pytest.approx(4.75)
    assert (scan.acceptance.accepted, scan.acceptance.drafted) == (7504, 14000)


def test_interval_lines_alone_give_no_acceptance():
    text = "\n".join(
        line for line in read("interval_and_cumulative.log").splitlines()
        if "Interval" in line
    )  # fmt: skip
    scan = scan_log(text)
    assert scan.acceptance is None and scan.interval_lines == 3


def test_missing_weight_lines_are_found_in_their_usual_wordings():
    scan = scan_log(read("missing_weights.log"))
    assert len(scan.missing_weight_lines) == 3
    assert all("WARNING" in line for line in scan.missing_weight_lines)


@pytest.mark.parametrize(
    "line",
    [
        "[memory ledger pp_rank 1 tp_rank 0] embedding 0.50 MiB, draft 1.12 MiB",
        "on the last stage embed_tokens is a PPMissingLayer placeholder",
        "[drafter pp_rank 1 tp_rank 0] taps [-1, 1, 4, 6] (resident [4, 6], "
        "relayed [-1, 1]), KDA rollback per-row snapshots",
    ],
)
def test_ordinary_start_up_lines_are_not_missing_weight_warnings(line):
    assert scan_log(line).missing_weight_lines == []


def test_a_percent_becomes_a_fraction_and_must_match_the_counts():
    line = (
        "[MTP Stats         ] Average toks/fwd: 4.50, Accepted/Total Draft tokens: "
        "350/700, Acceptance rate: 50.00%, Accepted tokens distribution: {}"
    )
    assert parse_mtp_line(line).rate == 0.5
    with pytest.raises(LogError, match="disagrees"):
        parse_mtp_line(line.replace("50.00%", "55.00%"))
    with pytest.raises(LogError, match="unreadable"):
        parse_mtp_line("[MTP Stats         ] Average toks/fwd: 4.50")


def test_mtp_stats_json_reads_counts_and_accepts_a_percent_rate():
    stats = json.loads(read("mtp_stats_pp2_tp4.json"))
    acceptance = acceptance_from_stats(stats)
    assert acceptance.rate == pytest.approx(52 / 71)
    assert acceptance.source == "/debug/mtp_stats"
    as_percent = {**stats, "acceptance_rate": 100 * stats["acceptance_rate"]}
    assert acceptance_from_stats(as_percent).rate == pytest.approx(52 / 71)
    with pytest.raises(LogError, match="disagrees"):
        acceptance_from_stats({**stats, "acceptance_rate": 0.5})
    with pytest.raises(LogError, match="lacks a counter"):
        acceptance_from_stats({"enabled": True, "acceptance_rate": 0.7})
    assert acceptance_from_stats({"enabled": False}) is None
