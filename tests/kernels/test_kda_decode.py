"""atom/kernels/kda_decode.py and kda_conv.py against the torch decode
(gather, the reference math, scatter), and the decode kernel's fused form (q and k
normalised and the gates formed inside it) against the separate steps."""

import pytest
import torch

from atom.kernels import triton_available
from atom.kernels.kda_conv import ConvTiles, kda_conv_in_pool
from atom.model_engine.batch import SeqWork
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_ops import kda_backend
from atom.model_ops.kda import l2_normalize
from atom.model_ops.kda_backend import (
    KDAGates,
    StateSlots,
    TorchKDABackend,
    select_kda_backend,
    torch_conv,
    torch_decode,
)
from tests.kernels.devices import DEVICES


def step_inputs(device, seqs, rows, heads, dim, value_dtype):
    gen = torch.Generator(device=device).manual_seed(rows)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    # q, k, v as the layer makes them: views of one conv output, strided.
    mixed = randn(seqs, rows, 3 * heads * dim).to(value_dtype)
    q, k, v = (
        part.reshape(seqs, rows, heads, dim) for part in mixed.split(heads * dim, -1)
    )
    g = -torch.rand(seqs, rows, heads, dim, generator=gen, device=device)
    beta = torch.rand(seqs, rows, heads, generator=gen, device=device)
    return l2_normalize(q), l2_normalize(k), v, g, beta


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,verify", [(1, False), (4, True)])
def test_kernel_updates_the_pool_as_the_torch_decode_does(device, rows, verify):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    seqs, heads, dim, num_slots = 3, 2, 16, 6
    value_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, g, beta = step_inputs(device, seqs, rows, heads, dim, value_dtype)
    gen = torch.Generator(device=device).manual_seed(7)
    pool = torch.randn(num_slots, heads, dim, dim, generator=gen, device=device)
    snapshots = torch.zeros(num_slots, 5, heads, dim, dim, device=device)
    slots = torch.tensor([4, 0, 2], device=device)
    context_lens = torch.tensor([4, 0, 9], dtype=torch.int32, device=device)
    pools = [pool.clone(), pool.clone()]
    snaps = [snapshots.clone(), snapshots.clone()] if verify else [None, None]
    triton = select_kda_backend(device, "triton")
    assert triton.name == "triton"
    o = triton.decode(
        q, k, v, g, beta, StateSlots(pools[0], slots, context_lens, snaps[0])
    )
    o_ref = torch_decode(
        q, k, v, g, beta, StateSlots(pools[1], slots, context_lens, snaps[1])
    )
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pools[0], pools[1], rtol=1e-4, atol=1e-4)
    # Slots no sequence names are left alone.
    untouched = [1, 3, 5]
    assert torch.equal(pools[0][untouched], pool[untouched])
    if verify:
        torch.testing.assert_close(snaps[0], snaps[1], rtol=1e-4, atol=1e-4)


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["kimi-linear", "k3"])
@pytest.mark.parametrize(
    "lengths",
    [[1, 1, 1], [4, 4, 4], [4, 2, 3]],  # decode; verify; verify of uneven drafts
    ids=["decode", "verify", "verify-uneven"],
)
def test_fused_decode_equals_the_separate_steps(
    device, lower_bound, lengths, monkeypatch
):
    """`decode_raw` of the triton backend (one kernel) against the default one of
    the torch backend (the torch norms and gates, `pad`, `torch_decode`): outputs,
    pools and snapshots, for fresh and continuing sequences of several heads; the
    padded rows of uneven drafts leave the states alone in both."""
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    heads, dim, num_slots = 3, 16, 6
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(sum(lengths))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    verify = max(lengths) > 1
    metadata = conv_step(device, lengths)
    tokens, width = sum(lengths), heads * dim
    conved = randn(len(lengths), max(lengths), 3 * width).to(dtype)
    # The projections' rows: f a strided view, with values in softplus's linear
    # range (> 20); beta's logits fp32, as the layer makes them.
    f = (randn(tokens, 2 * width) * 12)[:, :width].to(dtype)
    b_logits = randn(tokens, heads) * 4
    a_log = randn(heads)
    gates = KDAGates(f, b_logits, a_log, randn(width), lower_bound)
    pool = randn(num_slots, heads, dim, dim)
    snapshots = torch.zeros(num_slots, 5, heads, dim, dim, device=device)
    slots = torch.tensor([4, 0, 2], device=device)
    context_lens = torch.tensor([4, 0, 9], dtype=torch.int32, device=device)
    pools = [pool.clone(), pool.clone()]
    snaps = [snapshots.clone(), snapshots.clone()] if verify else [None, None]
    triton = select_kda_backend(device, "triton")
    with monkeypatch.context() as patch:  # the kernel alone: no separate steps
        patch.setattr(kda_backend, "prepare", None)
        o = triton.decode_raw(
            conved, gates, StateSlots(pools[0], slots, context_lens, snaps[0]), metadata
        )
    o_ref = TorchKDABackend().decode_raw(
        conved, gates, StateSlots(pools[1], slots, context_lens, snaps[1]), metadata
    )
    tolerance = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o, o_ref, **tolerance)
    torch.testing.assert_close(pools[0], pools[1], **tolerance)
    untouched = [1, 3, 5]
    assert torch.equal(pools[0][untouched], pool[untouched])
    if verify:
        torch.testing.assert_close(snaps[0], snaps[1], **tolerance)


def test_triton_backend_needs_triton_on_its_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton KDA backend"):
        select_kda_backend("cpu", "triton")
    assert select_kda_backend("cpu").name == "torch"


def conv_step(device, lengths):
    works = [
        SeqWork(
            seq_id=i,
            token_ids=[1] * n,
            context_len=8,
            block_table=list(range(8)),
            state_slot=i,
            num_drafts=n - 1,
        )
        for i, n in enumerate(lengths)
    ]
    return prepare_inputs(works, 16, device)[2]


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "lengths,verify,tiles",
    [
        ([1, 1, 1], False, None),  # decode
        ([4, 2, 3], True, None),  # verify
        ([70, 2, 33], False, None),  # prefill: several tiles of rows, uneven prompts
        # Tiles shorter than the history: the first two each read part of it.
        ([9, 2, 5], False, ConvTiles(2, 8, 2)),
        ([3, 2, 1], True, ConvTiles(2, 16, 2)),
    ],
)
def test_conv_kernel_updates_the_pool_as_the_torch_conv_does(
    device, lengths, verify, tiles
):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    channels, width, num_slots = 24, 4, 6
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(len(lengths) + sum(lengths))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    metadata = conv_step(device, lengths)
    mixed = metadata.pad(randn(sum(lengths), channels))
    weight = randn(channels, width).float()
    pool = randn(num_slots, channels, width - 1)
    snapshots = torch.zeros(
        num_slots, 5, channels, width - 1, dtype=dtype, device=device
    )
    slots = torch.tensor([4, 0, 2], device=device)
    context_lens = torch.tensor([4, 0, 9], dtype=torch.int32, device=device)
    pools = [pool.clone(), pool.clone()]
    snaps = [snapshots.clone(), snapshots.clone()] if verify else [None, None]
    if tiles is None:  # as the backend runs it
        triton = select_kda_backend(device, "triton")
        y = triton.conv(
            mixed, weight, StateSlots(pools[0], slots, context_lens, snaps[0]), metadata
        )
    else:
        y = kda_conv_in_pool(
            mixed,
            weight,
            pools[0],
            slots,
            context_lens,
            metadata.query_start_loc,
            snaps[0],
            tiles,
        )
    y_ref = torch_conv(
        mixed, weight, StateSlots(pools[1], slots, context_lens, snaps[1]), metadata
    )
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    real = metadata.unpad  # rows past a sequence's length are padding
    torch.testing.assert_close(real(y), real(y_ref), **tolerance)
    torch.testing.assert_close(pools[0], pools[1], **tolerance)
    if verify:
        for b, n in enumerate(lengths):  # the rows each sequence really has
            slot = slots[b]
            torch.testing.assert_close(snaps[0][slot, :n], snaps[1][slot, :n])


@pytest.mark.kernels
def test_short_prefills_through_the_decode_kernels_equal_the_chunked_prefill():
    """The triton backend runs short prompts row by row in the state pools: the
    logits of a prefill of two uneven prompts, then of a second chunk continuing
    the first one's states, equal the torch backend's chunked prefill."""
    if not triton_available("cpu"):
        pytest.skip("triton cannot run here")
    from tests.models.kimi_helpers import bind_caches, build_target, logits_of, work

    chunks = [
        [work(range(1, 8), slot=0), work(range(3, 6), slot=1, first_block=16)],
        [work(range(8, 13), context_len=7, slot=0)],
    ]
    logits = {}
    for choice in ("torch", "triton"):
        model, _ = build_target("tiny-kimi-k3", kda_backend=choice)
        bind_caches(model)
        logits[choice] = [logits_of(model, chunk) for chunk in chunks]
    backend = select_kda_backend("cpu", "triton")
    assert backend.runs_as_decode(2, 7)  # both chunks took the decode kernels
    assert not backend.runs_as_decode(1, backend.max_decode_prefill_rows + 1)
    assert not backend.runs_as_decode(64, backend.max_decode_prefill_rows)
    assert backend.runs_as_decode(4096, 1)  # decode always
    for ours, reference in zip(logits["triton"], logits["torch"]):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.kernels
def test_decode_and_verify_through_the_fused_kernel_equal_the_torch_backend():
    """The layer's decode and verify steps on the triton backend (q, k's norms and
    the gates inside the decode kernel) give the torch backend's logits: a decode
    row of two sequences, then a verify of uneven drafts. Kimi Linear's softplus
    gate here; K3's bounded one is checked against the separate steps above (a
    second tiny model through the interpreter cost the CPU suite 13 s)."""
    if not triton_available("cpu"):
        pytest.skip("triton cannot run here")
    from tests.models.kimi_helpers import bind_caches, build_target, logits_of, work

    steps = [
        [work(range(1, 6), slot=0), work(range(3, 6), slot=1, first_block=16)],
        [work([7], context_len=5, slot=0), work([9], context_len=3, slot=1)],
        [
            work([8, 2, 4], context_len=6, slot=0, num_drafts=2),
            work([5, 6], context_len=4, slot=1, first_block=16, num_drafts=1),
        ],
    ]
    logits = {}
    for choice in ("torch", "triton"):
        model, _ = build_target("tiny-kimi-linear", kda_backend=choice)
        bind_caches(model, spec_rows=3)
        logits[choice] = [logits_of(model, step) for step in steps]
    for ours, reference in zip(logits["triton"], logits["torch"]):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
