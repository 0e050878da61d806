"""`atom serve --headless`: a node other than 0 runs its ranks and nothing else.

It joins node 0's rendezvous, starts the ranks it holds and supervises them. Node 0
drives them over the network; this process only decides when the node ends: when
node 0 closes the world (every rank returns: exit 0), or when a rank dies or node
0 is lost (exit 1, after telling the other nodes why). Its ranks die with it, so a
node leaves no orphans whichever way it ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from multiprocessing import connection

from atom.config import Config
from atom.distributed.dist_interface import use_node_interface
from atom.distributed.node_layout import NodeLayoutError, torchrun_settings
from atom.distributed.node_membership import NodeMembership
from atom.model_engine.arg_utils import EngineArgs
from atom.model_engine.worker import choose_backend, start_ranks
from atom.model_loader.model_fingerprint import model_fingerprint
from atom.utils.clean_exit import exit_cleanly_on
from atom.utils.log_format import configure_logging

logger = logging.getLogger(__name__)

POLL_S = 0.5
STOP_GRACE_S = 5.0


def runs_headless(args: argparse.Namespace) -> bool:
    """--headless, or a node other than 0 under torchrun (one command for all)."""
    try:
        torchrun = torchrun_settings(os.environ)
    except NodeLayoutError as error:
        raise SystemExit(f"atom serve: error: {error}") from None
    return args.headless or torchrun.get("node_rank", 0) != 0


def join_as_member(args: argparse.Namespace) -> tuple[Config, NodeMembership]:
    """This node's config, joined to node 0; NodeLayoutError on any refusal."""
    config = Config(**EngineArgs.from_cli_args(args).engine_kwargs())
    layout = config.node_layout
    if not layout.is_multinode or layout.node_rank == 0:
        raise NodeLayoutError(
            "--headless runs a node other than 0 of a multi-node world: give "
            f"--nnodes > 1 and --node-rank >= 1 (got --nnodes {layout.nnodes} "
            f"--node-rank {layout.node_rank}); node 0 serves without --headless"
        )
    use_node_interface(layout)
    nodes = NodeMembership(config, choose_backend(config), model_fingerprint(config))
    return config, nodes


def supervise(config: Config, nodes: NodeMembership, procs: list) -> int:
    """Wait for this node's end; its exit status."""
    layout = config.node_layout
    ranks = dict(zip(layout.my_ranks, procs))
    while True:
        connection.wait([proc.sentinel for proc in procs], POLL_S)
        lost = nodes.lost()
        if lost is not None:
            logger.error("%s; node %d stops its ranks", lost, layout.node_rank)
            return 1
        for rank, proc in ranks.items():
            if proc.exitcode not in (None, 0):
                reason = (
                    f"rank {rank} ({layout.describe_rank(rank)}) exited with code "
                    f"{proc.exitcode}"
                )
                logger.error("%s; node %d stops", reason, layout.node_rank)
                nodes.report_failure(reason)
                return 1
        if all(proc.exitcode == 0 for proc in procs):
            logger.info("node 0 closed the world; node %d exits", layout.node_rank)
            return 0


def run_headless(args: argparse.Namespace) -> None:
    with exit_cleanly_on(signal.SIGTERM, signal.SIGINT):
        status = run_node(args)
    raise SystemExit(status)


def run_node(args: argparse.Namespace) -> int:
    """Join node 0, run this node's ranks until the node ends; its exit status."""
    configure_logging(logging.INFO)
    try:
        config, nodes = join_as_member(args)
    except NodeLayoutError as error:
        raise SystemExit(f"atom serve --headless: {error}") from None
    procs, lifeline = start_ranks(config, None, None)
    try:
        return supervise(config, nodes, procs)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=STOP_GRACE_S)
        lifeline.close()
        nodes.close()
