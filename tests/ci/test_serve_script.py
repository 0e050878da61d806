"""scripts/ci/serve.sh around a real `atom serve` of the tiny model: the command
runs against a ready, warmed-up server, its status comes back, and the server is
gone afterwards; bad usage and a server that cannot start are reported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atom.distributed.rank_process import free_port
from tests.process_helpers import is_running

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVE = ["bash", str(REPO_ROOT / "scripts" / "ci" / "serve.sh")]
# Prints what serve.sh hands the command, then exits 5.
PROBE = (
    "import json, os, urllib.request\n"
    "url = os.environ['ATOM_SERVER_URL']\n"
    "info = json.load(urllib.request.urlopen(url + '/server_info'))\n"
    "print('SERVED', os.environ['ATOM_SERVED_MODEL'], info['served_model_name'])\n"
    "raise SystemExit(5)\n"
)


def serve(tmp_path, *options, command=(sys.executable, "-c", PROBE)):
    env = {**os.environ, "PYTHON": sys.executable}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])
    )
    return subprocess.run(
        [*SERVE, "--port", str(free_port()), "--log", str(tmp_path / "server.log"),
         *options, "--", *command],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_the_command_runs_against_a_warm_server_that_is_stopped_after(tmp_path):
    done = serve(
        tmp_path, "--mtp-stats", str(tmp_path / "mtp.json"),
        "--serve-args", "--model tiny-kimi-k3 --device cpu",
    )  # fmt: skip
    assert done.returncode == 5, done.stdout + done.stderr
    assert "SERVED tiny-kimi-k3 tiny-kimi-k3" in done.stdout
    log = (tmp_path / "server.log").read_text()
    assert log.count('"POST /v1/completions HTTP/1.1" 200') == 1  # the warm-up
    assert (tmp_path / "mtp.json").read_text() == '{"enabled":false}'
    pid = int(done.stdout.split("server (pid ")[1].split(")")[0])
    assert not is_running(pid)


def test_a_server_that_cannot_start_exits_3_with_its_log(tmp_path):
    done = serve(tmp_path, "--serve-args", "--model /nonexistent/folder --device cpu")
    assert done.returncode == 3
    assert "did not become ready" in done.stderr
    assert "nonexistent" in done.stderr  # the log's end is shown


@pytest.mark.parametrize(
    "options, message",
    [
        ([], "give --entry or --serve-args"),
        (["--serve-args", "-tp 2"], "name no --model"),
        (["--entry", "No such entry"], "no catalog entry named"),
        (["--entry", "Kimi-K3 DSpark PP2 P/D"], "name its side, producer or consumer"),
        (["--side", "producer", "--serve-args", "--model m"], "--side needs --entry"),
        (["--bogus"], "unknown option"),
    ],
)
def test_bad_usage_exits_2(tmp_path, options, message):
    done = serve(tmp_path, *options)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.slow
def test_a_pd_side_is_served_with_its_kv_transfer_config(tmp_path):
    side = {"extraArgs": "-tp 1", "gpus": 1,
            "log_markers": {"relay": 0, "kda_rollback": 1}}  # fmt: skip
    entry = {
        "model_name": "tiny P/D", "model_path": "tiny-kimi-k3", "env_vars": "",
        "extraArgs": "--device cpu", "runner": ["self-hosted", "cuda"],
        "platform": "cuda", "gpus": 2, "test_level": "manual",
        "accuracy_threshold": 0.1, "accuracy_baseline": 0.1,
        "accuracy_baseline_model": "tiny-kimi-k3", "_baseline_note": "",
        "acceptance_min": None,
        "pd": {role: {**side, "kv_transfer_config": {"kv_role": f"kv_{role}"}}
               for role in ("producer", "consumer")},
    }  # fmt: skip
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps([entry]))
    probe = (
        "import json, os, urllib.request\n"
        "url = os.environ['ATOM_SERVER_URL'] + '/kv_transfer_info'\n"
        "print('ROLE', json.load(urllib.request.urlopen(url))['kv_role'])\n"
        "print('DEVICES', os.environ.get('CUDA_VISIBLE_DEVICES'))\n"
    )
    done = serve(
        tmp_path, "--catalog", str(catalog), "--entry", "tiny P/D",
        "--side", "consumer", command=(sys.executable, "-c", probe),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ROLE kv_consumer" in done.stdout
    # The visible-devices variable reaches the server only, not the command.
    assert f"DEVICES {os.environ.get('CUDA_VISIBLE_DEVICES')}" in done.stdout
