"""The DSpark tap relay across pipeline stages (docs/pp_dspark.md).

Stages are real toy targets holding PPMissingLayers outside their layer range and
always a real `embed_tokens`; pipelines run in-process, stage after stage.
"""

import pytest
import torch

from atom.models.utils import PPMissingLayer
from atom.spec_decode.aux_capture import TapCapture, allocate_tap_buffers
from atom.spec_decode.pp_aux_relay import (
    AUX_KEY,
    PPAuxRelay,
    stage_layer_range,
    tap_is_resident,
)
from atom.utils.forward_context import ForwardContext, set_forward_context
from tests.toy_target import ToyBaseModel

LAYERS, HIDDEN, VOCAB, MAX_TOKENS = 8, 16, 64, 32
TAPS = [-1, 1, 4, 6]
IDS = torch.tensor([3, 17, 42, 5, 60, 0, 11])


def stage(start: int, end: int) -> ToyBaseModel:
    return ToyBaseModel(LAYERS, HIDDEN, VOCAB, (start, end))


def relay_of(model: ToyBaseModel, taps=TAPS) -> PPAuxRelay:
    return PPAuxRelay(model, taps, HIDDEN, MAX_TOKENS)


def reference_taps(ids: torch.Tensor = IDS) -> dict[int, torch.Tensor]:
    """Every tap of a single-stage forward, computed without hooks."""
    model = stage(0, LAYERS)
    hidden = model.embed_tokens(ids)
    taps = {-1: hidden}
    for i, layer in enumerate(model.layers):
        out = layer(hidden)
        taps[i] = layer.aux_hidden_state(out)
        hidden = out[1] + out[0]
    return taps


def reference_hidden_before(layer: int) -> torch.Tensor:
    return reference_taps()[layer - 1]


def drafter_capture(
    last: ToyBaseModel,
) -> tuple[dict[int, torch.Tensor], TapCapture]:
    """The last stage's drafter side: buffers and hooks for its resident taps."""
    resident = [t for t in TAPS if tap_is_resident(last, t)]
    buffers = dict(
        zip(resident, allocate_tap_buffers(len(resident), MAX_TOKENS, HIDDEN))
    )
    return buffers, TapCapture(last, buffers)


def run_pipeline(bounds: list[tuple[int, int]], ids: torch.Tensor = IDS):
    """Every tap's rows as the drafter sees them after one forward through the
    given stages: its own buffers, the rest unpacked from the relay."""
    stages = [stage(*b) for b in bounds]
    relays = [relay_of(s) for s in stages]
    buffers, _ = drafter_capture(stages[-1])
    hidden, aux = None, None
    for model, relay in zip(stages, relays):
        with set_forward_context(ForwardContext()):
            hidden = model(ids if relay.is_first else None, hidden)
        if relay.is_last:
            relayed = relay.unpack(aux, ids.numel())
        else:
            aux = relay.pack(aux, ids.numel())
    taps = {t: buffer[: ids.numel()] for t, buffer in buffers.items()}
    return {**relayed, **taps}, relays


def test_residency_is_structural():
    first, last = stage(0, 4), stage(4, 8)
    assert tap_is_resident(first, -1) and tap_is_resident(first, 1)
    assert not tap_is_resident(first, 4)
    # The last stage holds a real embedding, yet -1 is not resident there.
    assert not isinstance(last.embed_tokens, PPMissingLayer)
    assert not tap_is_resident(last, -1)
    assert tap_is_resident(last, 4) and tap_is_resident(last, 6)
    assert stage_layer_range(last) == (4, 8)
    with pytest.raises(ValueError, match="outside"):
        tap_is_resident(last, LAYERS)


def test_first_stage_captures_embedding_and_own_taps_in_order():
    model = stage(0, 4)
    relay = relay_of(model)
    assert (relay.is_first, relay.is_last) == (True, False)
    assert relay.own == [-1, 1] and relay.incoming == [] and relay.outgoing == [-1, 1]
    with set_forward_context(ForwardContext()):
        model(IDS)
    packed = relay.pack(None, IDS.numel())
    ref = reference_taps()
    assert packed.shape == (IDS.numel(), 2 * HIDDEN)
    assert torch.equal(packed[:, :HIDDEN], ref[-1])
    assert torch.equal(packed[:, HIDDEN:], ref[1])


def test_middle_stage_relays_incoming_then_own():
    model = stage(3, 5)
    relay = relay_of(model)
    assert relay.own == [4] and relay.incoming == [-1, 1]
    assert relay.outgoing == [-1, 1, 4]
    ref = reference_taps()
    received = torch.cat([ref[-1], ref[1]], dim=-1)
    with set_forward_context(ForwardContext()):
        model(None, reference_hidden_before(3))
    packed = relay.pack(received, IDS.numel())
    assert torch.equal(packed[:, : 2 * HIDDEN], received)
    assert torch.equal(packed[:, 2 * HIDDEN :], ref[4])


def test_tapless_middle_passes_the_block_through():
    model = stage(2, 4)
    relay = relay_of(model, [-1, 1, 6])
    # Taps of later stages (6) are not incoming: the rule is id < start.
    assert relay.own == [] and relay.incoming == [-1, 1]
    assert relay.buffers == {} and relay.capture is None
    received = torch.randn(IDS.numel(), 2 * HIDDEN)
    assert torch.equal(relay.pack(received, IDS.numel()), received)


def test_stage_with_nothing_to_send_packs_none():
    relay = relay_of(stage(0, 1), [5, 6])
    assert relay.own == [] and relay.outgoing == []
    assert relay.pack(None, IDS.numel()) is None


def test_last_stage_has_no_relay_buffers_and_no_embedding_hooks():
    last = stage(4, 8)
    relay = relay_of(last)
    assert relay.is_last and relay.buffers == {} and relay.capture is None
    assert relay.own == [4, 6] and relay.incoming == [-1, 1] and relay.outgoing == []
    buffers, capture = drafter_capture(last)
    assert capture.layer_ids == [4, 6] and sorted(buffers) == [4, 6]
    assert len(last.embed_tokens._forward_hooks) == 0
    assert len(last.layers[4]._forward_hooks) == 1
    # Running the embedding (as a draft forward would) records nothing.
    with set_forward_context(ForwardContext()):
        last.embed_tokens(IDS)
    assert all(torch.count_nonzero(b) == 0 for b in buffers.values())


def test_unpack_names_each_relayed_tap():
    relay = relay_of(stage(4, 8))
    ref = reference_taps()
    received = torch.cat([ref[-1], ref[1]], dim=-1)
    taps = relay.unpack(received, IDS.numel())
    assert sorted(taps) == [-1, 1]
    assert torch.equal(taps[-1], ref[-1]) and torch.equal(taps[1], ref[1])


@pytest.mark.parametrize(
    "bounds",
    [
        [(0, 4), (4, 8)],
        [(0, 2), (2, 8)],
        [(0, 3), (3, 5), (5, 8)],
        [(0, 1), (1, 2), (2, 8)],
        [(0, 2), (2, 4), (4, 8)],
    ],
)
def test_pipeline_buffers_bit_identical_to_single_stage(bounds):
    single, _ = run_pipeline([(0, LAYERS)])
    split, relays = run_pipeline(bounds)
    assert sorted(single) == sorted(split) == TAPS
    for tap in TAPS:
        assert torch.equal(single[tap], split[tap])
    assert torch.count_nonzero(split[-1]) > 0
    for sender, receiver in zip(relays, relays[1:]):
        assert receiver.incoming == sender.outgoing


def test_missing_block_and_width_mismatch_raise():
    middle = relay_of(stage(3, 5))
    with pytest.raises(RuntimeError, match=f"missing '{AUX_KEY}'"):
        middle.pack(None, IDS.numel())
    with pytest.raises(ValueError, match="expected"):
        middle.pack(torch.zeros(IDS.numel(), 3 * HIDDEN), IDS.numel())
    last = relay_of(stage(4, 8))
    with pytest.raises(RuntimeError, match="missing"):
        last.unpack(None, IDS.numel())
    with pytest.raises(ValueError, match="expected"):
        last.unpack(torch.zeros(IDS.numel(), HIDDEN), IDS.numel())
    first = relay_of(stage(0, 4))
    with pytest.raises(ValueError, match="expects no relayed taps"):
        first.pack(torch.zeros(IDS.numel(), HIDDEN), IDS.numel())


def test_draft_forward_writes_nothing():
    model = stage(0, 4)
    relay = relay_of(model)
    with set_forward_context(ForwardContext(is_draft=True)):
        model(IDS)
    assert all(torch.count_nonzero(b) == 0 for b in relay.buffers.values())
    # The hook re-reads the flag per call: the next target forward records.
    with set_forward_context(ForwardContext()):
        model(IDS)
    assert torch.equal(relay.buffers[-1][: IDS.numel()], reference_taps()[-1])


def test_a_forward_longer_than_the_tap_buffers_is_refused():
    model = stage(0, 4)
    relay_of(model)
    with set_forward_context(ForwardContext()):
        with pytest.raises(RuntimeError, match="exceed"):
            model(torch.zeros(MAX_TOKENS + 1, dtype=torch.long))
