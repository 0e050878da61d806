"""Real multi-process (gloo) checks: each TP layer equals its tp=1 result, and the
stage-to-stage transport carries every key, including a 3-D tensor."""

import torch

from atom.distributed.launch import run_ranks
from atom.distributed.parallel_state import get_pp_group, get_tp_group
from atom.distributed.pp_comm import recv_tensor_dict, send_tensor_dict
from atom.model_ops.embed_head import ParallelLMHead, VocabParallelEmbedding
from atom.model_ops.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

IN, OUT, VOCAB = 16, 24, 32


def full_weights():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(OUT, IN, generator=g),
        "b": torch.randn(OUT, generator=g),
        "w_row": torch.randn(OUT, OUT, generator=g),
        "gate": torch.randn(8, IN, generator=g),
        "up": torch.randn(16, IN, generator=g),
        "emb": torch.randn(VOCAB, IN, generator=g),
        "x": torch.randn(5, IN, generator=g),
        "ids": torch.tensor([0, 7, 8, 31, 15, 16]),
    }


def layer_outputs(rank):
    t = full_weights()
    tp = get_tp_group()
    col = ColumnParallelLinear(IN, OUT, bias=True)
    col.weight.weight_loader(col.weight, t["w"])
    col.bias.weight_loader(col.bias, t["b"])
    row = RowParallelLinear(OUT, OUT)
    row.weight.weight_loader(row.weight, t["w_row"])
    merged = MergedColumnParallelLinear(IN, [8, 16])
    merged.weight.weight_loader(merged.weight, t["gate"], 0)
    merged.weight.weight_loader(merged.weight, t["up"], 1)
    rep = ReplicatedLinear(IN, OUT)
    rep.weight.weight_loader(rep.weight, t["w"])
    emb = VocabParallelEmbedding(VOCAB, IN)
    emb.weight.weight_loader(emb.weight, t["emb"])
    head = ParallelLMHead(VOCAB, IN)
    head.weight.weight_loader(head.weight, t["emb"])
    hidden = tp.all_gather(col(t["x"]), dim=-1)  # column output gathered back
    gate, up = merged(t["x"]).split([8 // tp.world_size, 16 // tp.world_size], dim=-1)
    return {
        "column": hidden,
        "row": row(
            hidden[:, tp.rank_in_group * OUT // tp.world_size :][
                :, : OUT // tp.world_size
            ]
        ),
        "merged": torch.cat([tp.all_gather(gate), tp.all_gather(up)], dim=-1),
        "replicated": rep(t["x"]),
        "embedding": emb(t["ids"]),
        "logits": head.compute_logits(t["x"]),
    }


def reference():
    t = full_weights()
    hidden = t["x"] @ t["w"].t() + t["b"]
    return {
        "column": hidden,
        "row": hidden @ t["w_row"].t(),
        "merged": torch.cat([t["x"] @ t["gate"].t(), t["x"] @ t["up"].t()], dim=-1),
        "replicated": t["x"] @ t["w"].t(),
        "embedding": t["emb"][t["ids"]],
        "logits": t["x"] @ t["emb"].t(),
    }


def test_tensor_parallel_layers_match_tp1():
    expected = reference()
    for tp in (2, 4):
        for rank_out in run_ranks(layer_outputs, tp_size=tp):
            for name, value in expected.items():
                torch.testing.assert_close(rank_out[name], value, msg=f"{name} tp={tp}")


def exchange(rank):
    pp, tp = get_pp_group(), get_tp_group()
    payload = {
        "hidden_states": torch.full((3, 4), float(tp.rank_in_group)),
        "block_residual": torch.arange(24.0).view(3, 2, 4) + tp.rank_in_group,
        "aux_hidden_states": torch.ones(3, 8, dtype=torch.bfloat16),
    }
    if pp.is_first_rank:
        send_tensor_dict(payload)
        return None
    got = recv_tensor_dict(torch.device("cpu"), expected_keys=set(payload))
    return {k: v.clone() for k, v in got.items()}, payload


def test_stage_transport_carries_every_key():
    results = run_ranks(exchange, tp_size=2, pp_size=2)
    for got, sent in results[2:]:
        assert set(got) == set(sent)
        for key in sent:
            assert got[key].dtype == sent[key].dtype
            assert torch.equal(got[key], sent[key]), key


def exchange_into_buffers(rank):
    """A graph's static payload as `into`: fitting keys land in its leading rows,
    a key of another dtype gets a tensor of its own."""
    payload = {
        "hidden_states": torch.arange(12.0).view(3, 4),
        "residual": torch.ones(3, 4, dtype=torch.bfloat16),
    }
    if get_pp_group().is_first_rank:
        send_tensor_dict(payload)
        return None
    buffers = {"hidden_states": torch.zeros(8, 4), "residual": torch.zeros(8, 4)}
    got = recv_tensor_dict(torch.device("cpu"), set(payload), into=buffers)
    return {
        "in_place": got["hidden_states"].data_ptr()
        == buffers["hidden_states"].data_ptr(),
        "buffer_rows": buffers["hidden_states"][:3].clone(),
        "residual_own": got["residual"].data_ptr() != buffers["residual"].data_ptr(),
        "residual": got["residual"].clone(),
        "sent": payload,
    }


def test_stage_transport_receives_into_persistent_buffers():
    got = run_ranks(exchange_into_buffers, tp_size=1, pp_size=2)[1]
    assert got["in_place"] and got["residual_own"]
    assert torch.equal(got["buffer_rows"], got["sent"]["hidden_states"])
    assert torch.equal(got["residual"], got["sent"]["residual"])


def mismatched_keys(rank):
    if get_pp_group().is_first_rank:
        send_tensor_dict({"hidden_states": torch.zeros(2, 2)})
        return "sent"
    try:
        recv_tensor_dict(
            torch.device("cpu"), expected_keys={"hidden_states", "residual"}
        )
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_receiver_checks_the_declared_keys():
    _, message = run_ranks(mismatched_keys, tp_size=1, pp_size=2)
    assert "differ from the declared" in message
