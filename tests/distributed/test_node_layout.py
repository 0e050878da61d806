"""Multi-node layout: placement, refusals, torchrun's variables, the rendezvous
check and the model fingerprint (real stores, real checkpoints; no processes)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from atom.config import Config
from atom.distributed.dist_interface import interface_of, use_node_interface
from atom.distributed.node_layout import NodeLayout, NodeLayoutError, torchrun_settings
from atom.distributed.node_membership import NodeMembership
from atom.distributed.node_rendezvous import (
    connect_store,
    first_difference,
    meet_as_head,
    meet_as_member,
    node_store,
)
from atom.distributed.rank_process import (
    SOCKET_IFNAME_VARIABLES,
    free_port,
    loopback_interface,
)
from atom.entrypoints.cli import make_parser
from atom.model_engine.arg_utils import EngineArgs
from atom.model_loader.model_fingerprint import (
    checkpoint_fingerprint,
    model_fingerprint,
)

NODES = dict(master_addr="127.0.0.1", master_port=29500)


def layout(tp: int, pp: int, nnodes: int = 2, **kwargs) -> NodeLayout:
    return NodeLayout(tp, pp, nnodes=nnodes, **{**NODES, **kwargs})


def test_each_stage_is_one_node_at_pp2_tp4_over_two_nodes():
    nodes = layout(4, 2, node_rank=1)
    assert nodes.local_ranks == 4
    assert list(nodes.my_ranks) == [4, 5, 6, 7]
    assert nodes.remote_ranks == [4, 5, 6, 7]
    assert nodes.placement_lines() == [
        "node 0: ranks 0-3 = pp stage 0 (tp 4 each)",
        "node 1: ranks 4-7 = pp stage 1 (tp 4 each)",
    ]
    assert nodes.describe_rank(5) == "pp_rank 1, tp_rank 1, node 1"


def test_a_node_may_hold_several_stages():
    assert layout(2, 4).placement_lines() == [
        "node 0: ranks 0-3 = pp stages 0, 1 (tp 2 each)",
        "node 1: ranks 4-7 = pp stages 2, 3 (tp 2 each)",
    ]


def test_one_node_needs_no_address_and_names_no_node():
    single = NodeLayout(2, 2)
    assert not single.is_multinode and single.local_ranks == 4
    assert single.describe_rank(3) == "pp_rank 1, tp_rank 1"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=3, pp=1), "3 ranks cannot be split evenly over 2 nodes"),
        (dict(tp=4, pp=1), "tp 4 does not divide the 2 ranks of each node"),
        (dict(tp=2, pp=2, node_rank=2), "--node-rank must lie in 0..1"),
        (dict(tp=2, pp=2, master_addr=None), "needs --master-addr"),
        (dict(tp=2, pp=2, master_port=None), "needs --master-port"),
        (dict(tp=2, pp=2, join_timeout=0), "--join-timeout must be > 0"),
    ],
)
def test_layouts_that_cannot_run_are_refused(kwargs, message):
    tp, pp = kwargs.pop("tp"), kwargs.pop("pp")
    with pytest.raises(NodeLayoutError, match=message):
        layout(tp, pp, **kwargs)


TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "job",
    "WORLD_SIZE": "2",
    "RANK": "1",
    "GROUP_RANK": "1",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def test_torchrun_variables_give_the_node_settings():
    assert torchrun_settings(TORCHRUN) == {
        "nnodes": 2,
        "node_rank": 1,
        "master_addr": "10.0.0.1",
        "master_port": 29400,
        "store_hosted_elsewhere": True,
    }
    assert torchrun_settings({"WORLD_SIZE": "2"}) == {}
    with pytest.raises(NodeLayoutError, match="--nproc-per-node 1"):
        torchrun_settings({**TORCHRUN, "LOCAL_WORLD_SIZE": "4"})


def test_config_reads_torchrun_unless_nnodes_is_given(monkeypatch):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    config = Config(model="tiny-kimi-k3", pipeline_parallel_size=2)
    nodes = config.node_layout
    assert (nodes.nnodes, nodes.node_rank, nodes.master_port) == (2, 1, 29400)
    assert nodes.store_hosted_elsewhere


def test_serve_flags_reach_the_engine_settings():
    args = make_parser().parse_args(
        ["serve", "-pp", "2", "--nnodes", "2", "--node-rank", "1", "--headless",
         "--master-addr", "10.0.0.1", "--master-port", "29500",
         "--dist-interface", "eth1", "--join-timeout", "60", "--node-timeout", "9"]
    )  # fmt: skip
    engine = EngineArgs.from_cli_args(args)
    assert args.headless
    assert (engine.nnodes, engine.node_rank) == (2, 1)
    assert (engine.master_addr, engine.master_port) == ("10.0.0.1", 29500)
    assert (engine.dist_interface, engine.join_timeout, engine.node_timeout) == (
        "eth1",
        60.0,
        9.0,
    )


def test_loopback_master_picks_the_loopback_interface(monkeypatch):
    for variable in SOCKET_IFNAME_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert interface_of("127.0.0.1") == loopback_interface()
    assert use_node_interface(layout(1, 2)) == loopback_interface()
    with pytest.raises(NodeLayoutError, match="'no-such-nic' is not an interface"):
        use_node_interface(layout(1, 2, dist_interface="no-such-nic"))


def write_checkpoint(folder, tensors: dict[str, torch.Tensor]) -> str:
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def test_the_fingerprint_sees_the_weights_config_and_architecture(tmp_path):
    hf = Config(model="tiny-kimi-k3").hf_config
    a = write_checkpoint(tmp_path / "a", {"w": torch.zeros(4, 2)})
    b = write_checkpoint(tmp_path / "b", {"w": torch.zeros(2, 4)})
    same = {"target": checkpoint_fingerprint(a, hf), "draft": None}
    assert first_difference(same, dict(same)) is None
    other = {"target": checkpoint_fingerprint(b, hf), "draft": None}
    assert first_difference(other, same).startswith("target weights: ")
    k31 = model_fingerprint(Config(model="tiny-kimi-k31"))
    k3 = model_fingerprint(Config(model="tiny-kimi-k3"))
    assert first_difference(k31, k3) == (
        "target architecture: KimiK31ForConditionalGeneration vs "
        "KimiK3ForConditionalGeneration"
    )


def facts(tp: int, model: str = "m", max_num_seqs: int = 8) -> dict:
    nodes = layout(tp, 2)
    fingerprint = {"architecture": model, "config": "c", "weights": "w"}
    return {
        **nodes.facts(),
        "backend": "gloo",
        "settings": {"max_num_seqs": max_num_seqs},
        "model": {"target": fingerprint, "draft": None},
    }


def meet(facts_0: dict, facts_1: dict, join_timeout: float = 60.0) -> list:
    """Node 0 and node 1 meet over a real store; what each raised (or None)."""
    port = free_port()
    head = layout(2, 2, master_port=port, join_timeout=join_timeout)
    member = layout(2, 2, master_port=port, node_rank=1, join_timeout=join_timeout)
    server = connect_store(head, 30, host=True)
    raised: list = [None, None]

    def run(slot: int, fn, nodes: NodeLayout, store: dist.Store, mine: dict):
        try:
            fn(node_store(store), nodes, mine)
        except NodeLayoutError as error:
            raised[slot] = error

    threads = [threading.Thread(target=run, args=(0, meet_as_head, head, server,
                                                  facts_0))]  # fmt: skip
    if facts_1 is not None:
        client = connect_store(member, 30, host=False)
        threads.append(
            threading.Thread(
                target=run, args=(1, meet_as_member, member, client, facts_1)
            )
        )
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return raised


def test_nodes_that_agree_meet():
    assert meet(facts(2), facts(2)) == [None, None]


def test_a_node_with_another_world_setting_or_model_is_refused_on_both_sides():
    head, member = meet(facts(2), facts(1))
    assert (
        str(head)
        == str(member)
        == (
            "node 1 refused: world size 2 (pp 2 x tp 1, 2 nodes) instead of node 0's "
            "world size 4 (pp 2 x tp 2, 2 nodes)"
        )
    )
    head, member = meet(facts(2), facts(2, max_num_seqs=64))
    assert (
        str(head)
        == str(member)
        == ("node 1 refused: --max-num-seqs 64 instead of node 0's 8")
    )
    head, member = meet(facts(2), facts(2, model="other"))
    assert "another model: target architecture: other vs m" in str(head)
    assert str(head) == str(member)


def test_a_node_that_never_joins_is_named():
    head, _ = meet(facts(2), None, join_timeout=0.5)
    assert "node 1 did not join the rendezvous at 127.0.0.1:" in str(head)


def test_a_node_that_finds_no_node_0_says_where_it_looked():
    nobody = layout(2, 2, master_port=free_port(), node_rank=1)
    with pytest.raises(NodeLayoutError, match="could not reach node 0's rendezvous"):
        connect_store(nobody, 1, host=False)


FINGERPRINT = {"target": {"architecture": "m", "config": "c", "weights": "w"}}


@pytest.mark.parametrize(
    "end, reason",
    [
        # A hung or cut-off machine: its sockets stay open, its heartbeat stops.
        ("close", "node 1 sent no heartbeat for 1 s (--node-timeout)"),
        ("report_failure", "node 1 failed: rank 2 exited with code -9"),
    ],
)
def test_node_0_names_a_node_that_goes_silent_or_fails(end, reason):
    """Two real memberships over one store, joined from two threads."""
    settings = dict(model="tiny-kimi-k3", pipeline_parallel_size=2, nnodes=2)
    settings.update(master_addr="127.0.0.1", master_port=free_port())
    settings.update(node_timeout=1.0)
    joined: dict[int, NodeMembership] = {}

    def join(rank: int) -> None:
        joined[rank] = NodeMembership(
            Config(**settings, node_rank=rank), "gloo", FINGERPRINT
        )

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    head, member = joined[0], joined[1]
    try:
        assert member.lost() is None
        if end == "close":
            member.close()
        else:
            member.report_failure("rank 2 exited with code -9")
        deadline = time.monotonic() + 120
        while head.lost() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert head.lost() == reason
    finally:
        head.close()
        member.close()
