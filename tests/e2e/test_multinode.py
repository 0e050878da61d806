"""Two "nodes" on loopback: two independently started `atom serve` process trees.

Node 0 serves (engine, scheduler, HTTP, its ranks); node 1 runs `--headless` with
its ranks only. Greedy ids across the node boundary (pp2 x tp2 with DSpark, so the
tap relay and the drafter's embedding copy cross it) must equal the offline pp1 x
tp1 engine, served or offline (`LLMEngine(nnodes=2, ...)` as node 0); a clean close
of node 0 ends node 1 with status 0, and killing either node ends the other (node 0
exits non-zero and names node 1; node 1's ranks go with node 0); a wrong world size
or another model on node 1 is refused before any rank starts. Deadlines are generous: the machine may
be a loaded 2-core box, and no assertion is about time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from atom.distributed.rank_process import free_port
from tests.e2e.pp_probe import GREEDY, SETTINGS, T, corpus_prompts, make_engine
from tests.process_helpers import (
    descendant_pids,
    is_loopback,
    listening_addresses,
    rank_pids,
    survivors,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300
EXIT_TIMEOUT_S = 120
# Rank processes die with their node process; the resource tracker on its own
# schedule.
ORPHAN_DEADLINE_S = 30
K3 = ["--model", "tiny-kimi-k3"]
ENGINE_FLAGS = [
    "--device", "cpu", "--skip-tokenizer-init",
    "--max-model-len", str(SETTINGS["max_model_len"]),
    "--max-num-seqs", str(SETTINGS["max_num_seqs"]),
    "--max-num-batched-tokens", str(SETTINGS["max_num_batched_tokens"]),
    "--block-size", str(SETTINGS["block_size"]),
]  # fmt: skip
DSPARK_FLAGS = [
    "--method", "dspark", "--draft-model", "tiny-kimi-k3-dspark",
    "--num-speculative-tokens", str(T),
]  # fmt: skip

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread_torch")]


class Node:
    """`python -m atom.entrypoints.cli serve --nnodes 2 --node-rank R ...`."""

    def __init__(
        self, rank: int, master_port: int, flags: list[str], log_path: Path
    ) -> None:
        self.rank = rank
        self.log_path = log_path
        self.http_port = free_port()
        command = [sys.executable, "-m", "atom.entrypoints.cli", "serve"]
        command += ["--nnodes", "2", "--node-rank", str(rank)]
        command += ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
        command += ["--server-port", str(self.http_port), *flags]
        if rank:
            command.append("--headless")
        env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}"
               + os.environ.get("PYTHONPATH", "")}  # fmt: skip
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self) -> int:
        try:
            return self.process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"node {self.rank} did not exit:\n{self.log()}"
            ) from None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def start_nodes(tmp_path: Path, flags: list[str], flags_1: list[str] | None = None):
    master_port = free_port()
    nodes = [
        Node(0, master_port, flags, tmp_path / "node0.log"),
        Node(1, master_port, flags if flags_1 is None else flags_1,
             tmp_path / "node1.log"),
    ]  # fmt: skip
    return nodes


def wait_serving(nodes: list[Node]) -> None:
    """Until node 0 answers /health with 200 (both nodes must still run)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        for node in nodes:
            if node.process.poll() is not None:
                raise AssertionError(
                    f"node {node.rank} exited ({node.process.returncode}):\n"
                    f"{node.log()}"
                )
        try:
            if httpx.get(f"{nodes[0].url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"node 0 not serving in {STARTUP_TIMEOUT_S} s")


def processes_of(node: Node) -> list[int]:
    """The node's processes below it: its ranks, their fork server, the resource
    tracker."""
    return descendant_pids(node.process.pid)


@pytest.fixture(scope="module")
def offline_ids() -> list[list[int]]:
    """Greedy pp1 x tp1 ids without speculation."""
    engine = make_engine("tiny-kimi-k3")
    results = engine.generate(corpus_prompts(), GREEDY)
    engine.close()
    return [r["token_ids"] for r in results]


def test_pp2_tp2_dspark_over_two_nodes_then_node_0_dies(offline_ids, tmp_path):
    nodes = start_nodes(
        tmp_path, ["-pp", "2", "-tp", "2", *K3, *ENGINE_FLAGS, *DSPARK_FLAGS]
    )
    try:
        wait_serving(nodes)
        node_processes = [processes_of(node) for node in nodes]
        ranks_per_node = [len(rank_pids(node.process.pid)) for node in nodes]
        listening = {
            pid: listening_addresses(pid)
            for pid in [nodes[0].process.pid, *node_processes[0], *node_processes[1]]
        }
        served = []
        with httpx.Client(base_url=nodes[0].url, timeout=300) as client:
            for prompt in corpus_prompts():
                reply = client.post(
                    "/v1/completions",
                    json={"model": "tiny-kimi-k3", "prompt": prompt, "temperature": 0,
                          "max_tokens": GREEDY.max_tokens},
                )  # fmt: skip
                assert reply.status_code == 200, reply.text
                served.append(reply.json()["choices"][0]["token_ids"])
            stats = client.get("/debug/mtp_stats").json()
        nodes[0].process.send_signal(signal.SIGKILL)
        nodes[0].wait_exit()
        node_1_code = nodes[1].wait_exit()
    finally:
        for node in nodes:
            node.kill()
    assert served == offline_ids
    assert stats["enabled"] and stats["num_verify_steps"] > 0
    log_0, log_1 = nodes[0].log(), nodes[1].log()
    assert "placement: node 0: ranks 0-1 = pp stage 0 (tp 2 each)" in log_0
    assert "placement: node 1: ranks 2-3 = pp stage 1 (tp 2 each)" in log_1
    assert node_1_code != 0, log_1[-3000:]
    # The store, the HTTP server and gloo: loopback only, never every interface.
    assert listening[nodes[0].process.pid]
    assert all(is_loopback(a) for a in sum(listening.values(), [])), listening
    assert ranks_per_node == [2, 2]
    assert survivors(sum(node_processes, []), ORPHAN_DEADLINE_S) == []


def test_node_1_dies_and_node_0_reports_it(tmp_path):
    nodes = start_nodes(tmp_path, ["-pp", "2", "-tp", "1", *K3, *ENGINE_FLAGS])
    try:
        wait_serving(nodes)
        node_processes = processes_of(nodes[0]) + processes_of(nodes[1])
        nodes[1].process.send_signal(signal.SIGKILL)
        # /health is read while node 0 still answers; it may be gone already.
        reasons = []
        while nodes[0].process.poll() is None:
            try:
                reply = httpx.get(f"{nodes[0].url}/health", timeout=5)
            except httpx.HTTPError:
                break
            if reply.status_code == 503:
                reasons.append(reply.json()["reason"])
            time.sleep(0.2)
        code = nodes[0].wait_exit()
    finally:
        for node in nodes:
            node.kill()
    log_0 = nodes[0].log()
    assert code != 0, log_0[-3000:]
    assert "the engine died (node 1 " in log_0, log_0[-3000:]
    assert all("node 1" in reason for reason in reasons), reasons
    assert survivors(node_processes, ORPHAN_DEADLINE_S) == []


def test_the_offline_engine_is_node_0_and_a_clean_close_ends_node_1(
    offline_ids, tmp_path
):
    master_port = free_port()
    node_1 = Node(1, master_port, ["-pp", "2", "-tp", "1", *K3, *ENGINE_FLAGS],
                  tmp_path / "node1.log")  # fmt: skip
    try:
        engine = make_engine(
            "tiny-kimi-k3",
            pipeline_parallel_size=2,
            skip_tokenizer_init=True,
            nnodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=master_port,
        )
        try:
            results = engine.generate(corpus_prompts(), GREEDY)
        finally:
            engine.close()
        code = node_1.wait_exit()
    finally:
        node_1.kill()
    assert [r["token_ids"] for r in results] == offline_ids
    assert code == 0, node_1.log()[-3000:]
    assert "node 0 closed the world; node 1 exits" in node_1.log()


@pytest.mark.parametrize(
    "flags_1, refusal",
    [
        (["-pp", "2", "-tp", "1", *K3], "world size 2 (pp 2 x tp 1, 2 nodes) instead of "
         "node 0's world size 4 (pp 2 x tp 2, 2 nodes)"),
        (["-pp", "2", "-tp", "2", "--model", "tiny-kimi-k31"],
         "another model: target architecture: KimiK31ForConditionalGeneration"
         " vs KimiK3ForConditionalGeneration (this node's vs node 0's)"),
    ],
    ids=["world-size", "model"],
)  # fmt: skip
def test_a_mismatched_node_is_refused_before_serving(flags_1, refusal, tmp_path):
    flags_0 = ["-pp", "2", "-tp", "2", *K3, *ENGINE_FLAGS]
    nodes = start_nodes(tmp_path, flags_0, [*flags_1, *ENGINE_FLAGS])
    try:
        codes = [node.wait_exit() for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, code in zip(nodes, codes):
        log = node.log()
        assert code != 0, log
        assert refusal in log, log
        assert "Traceback" not in log, log
        assert "memory ledger" not in log  # no rank started
    assert "Uvicorn running" not in nodes[0].log()


def test_a_node_that_never_joins_is_named(tmp_path):
    node = Node(0, free_port(), ["-pp", "2", *K3, *ENGINE_FLAGS, "--join-timeout", "3"],
                tmp_path / "node0.log")  # fmt: skip
    try:
        code = node.wait_exit()
    finally:
        node.kill()
    log = node.log()
    assert code != 0
    assert "node 1 did not join the rendezvous" in log, log
    assert "Traceback" not in log, log
