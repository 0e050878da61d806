"""scripts/ci/accuracy_entry.sh --dry-run: the commands it runs for an aggregated
and a P/D catalog entry, checked without GPUs or servers."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRY = REPO_ROOT / "scripts" / "ci" / "accuracy_entry.sh"


def plan(name: str, out: Path) -> list[list[list[str]]]:
    """Each printed command, split into its `--`-separated parts."""
    env = {**os.environ, "PYTHON": sys.executable, "ATOM_PORT": "9000"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])
    )
    done = subprocess.run(
        ["bash", str(ENTRY), "--dry-run", name, str(out)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    commands = []
    for line in done.stdout.splitlines():
        parts, part = [], []
        for arg in shlex.split(line):
            if arg == "--":
                parts.append(part)
                part = []
            else:
                part.append(arg)
        commands.append([*parts, part])
    return commands


def option(part: list[str], flag: str) -> str:
    return part[part.index(flag) + 1]


def test_a_pd_entry_runs_producer_consumer_and_router_and_gates_both_logs(tmp_path):
    name = "MiniMax-M3 DSpark PP4 P/D"
    (producer, consumer, router, watchdog, client), (gate,) = plan(name, tmp_path)
    assert producer[:2] == consumer[:2] == ["bash", "scripts/ci/serve.sh"]
    assert option(producer, "--entry") == option(consumer, "--entry") == name
    assert (option(producer, "--side"), option(consumer, "--side")) == (
        "producer",
        "consumer",
    )
    assert (option(producer, "--port"), option(consumer, "--port")) == ("9001", "9002")
    assert option(producer, "--log") == f"{tmp_path}/producer.log"
    assert "--mtp-stats" not in producer
    # The consumer answers the completions: its log is the one watched and gated.
    assert option(consumer, "--log") == f"{tmp_path}/server.log"
    assert option(consumer, "--mtp-stats") == f"{tmp_path}/mtp_stats.json"
    assert router == [
        "bash", "scripts/ci/pd_proxy.sh", "http://127.0.0.1:9001",
        "http://127.0.0.1:9002", "9000", "/models/MiniMaxAI/MiniMax-M3",
        f"{tmp_path}/proxy.log",
    ]  # fmt: skip
    assert option(watchdog, "--log") == f"{tmp_path}/server.log"
    assert client[0] == "lm_eval"
    assert "base_url=http://127.0.0.1:9000/v1/completions" in option(
        client, "--model_args"
    )
    assert option(gate, "--entry") == name
    assert option(gate, "--server-log") == f"{tmp_path}/server.log"
    assert option(gate, "--producer-log") == f"{tmp_path}/producer.log"
    assert not list(tmp_path.iterdir())  # a dry run starts and writes nothing


def test_an_aggregated_entry_runs_one_server_as_before(tmp_path):
    (server, watchdog, client), (gate,) = plan("Kimi-K3 DSpark PP2", tmp_path)
    assert server[:2] == ["bash", "scripts/ci/serve.sh"] and "--side" not in server
    assert option(server, "--port") == "9000"
    assert option(server, "--log") == option(watchdog, "--log")
    assert client[0] == "lm_eval"
    assert "--producer-log" not in gate
