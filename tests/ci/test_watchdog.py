"""scripts/ci/watchdog.py: exit codes, and progress counted only on whole lines."""

import sys

from scripts.ci import watchdog


def test_the_command_exit_status_passes_through(tmp_path):
    log = tmp_path / "server.log"
    command = [sys.executable, "-c", "raise SystemExit(7)"]
    assert watchdog.main(["--log", str(log), "--idle", "60", "--", *command]) == 7


def test_no_progress_stops_the_command_group(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO Engine stats: running 64\n")
    marker = tmp_path / "survived"
    # The child would write the file after 60 s; it must be killed long before.
    command = [sys.executable, "-c",
               f"import time; time.sleep(60); open({str(marker)!r}, 'w')"]  # fmt: skip
    code = watchdog.main(["--log", str(log), "--idle", "0.5", "--", *command])
    assert code == watchdog.EXIT_NO_PROGRESS
    assert not marker.exists()


def test_the_time_limit_stops_the_command(tmp_path):
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    args = ["--log", str(tmp_path / "none.log"), "--idle", "600", "--limit", "0.5"]
    assert watchdog.main([*args, "--", *command]) == watchdog.EXIT_TIME_LIMIT


def test_progress_counts_finished_lines_only(tmp_path):
    log = tmp_path / "server.log"
    counter = watchdog.ProgressCounter(
        log, watchdog.re.compile(watchdog.DEFAULT_PROGRESS)
    )
    assert counter.poll() == 0  # no file yet
    done = 'INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK'
    log.write_text(f"{done}\n{done[:20]}")
    assert counter.poll() == 1
    with open(log, "a") as file:
        file.write(f"{done[20:]}\nINFO Engine stats\n")
    assert counter.poll() == 2
