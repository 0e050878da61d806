"""The layer contract (atom/models/interfaces.py): what the engine finds and binds."""

import pytest
import torch
from torch import nn

from atom.config import Config
from atom.model_engine.cache_engine import CacheEngine
from atom.models.interfaces import (
    PagedKVLayer,
    PipelineModel,
    RecurrentStateLayer,
    StateTensor,
    TapLayer,
    is_graph_capturable,
)
from atom.models.kimi.kda import KimiDeltaAttention
from atom.models.kimi.mla import KimiMLAttention
from atom.models.minimax_m3.attention import MiniMaxM3Attention
from atom.models.registry import get_model_class
from atom.models.utils import language_model_of


@pytest.mark.parametrize(
    "name, paged, recurrent",
    [
        ("tiny-kimi-linear", KimiMLAttention, KimiDeltaAttention),
        ("tiny-minimax-m3", MiniMaxM3Attention, None),
    ],
)
def test_targets_and_their_layers_declare_the_contract(name, paged, recurrent):
    config = Config(model=name)
    model = get_model_class(config.hf_config.architecture)(config)
    assert isinstance(model, PipelineModel)
    modules = list(model.modules())
    found = [type(m) for m in modules if isinstance(m, PagedKVLayer)]
    assert found and set(found) == {paged}
    states = [type(m) for m in modules if isinstance(m, RecurrentStateLayer)]
    assert set(states) == ({recurrent} if recurrent else set())
    assert all(isinstance(m, TapLayer) for m in language_model_of(model).model.layers)


class ToyState(nn.Module):
    """A recurrent layer of two named tensors, one of its own dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.bound = None

    def state_spec(self) -> tuple[StateTensor, ...]:
        return (StateTensor("a", (2,)), StateTensor("b", (3, 1), torch.float64))

    def bind_states(self, states, snapshots) -> None:
        self.bound = (states, snapshots)


def test_the_engine_allocates_what_a_state_layer_declares_and_rolls_all_back():
    layer = ToyState()
    cache = CacheEngine([layer], 1, 4, 2, 3, "cpu", torch.bfloat16)
    states, snapshots = layer.bound
    assert (states["a"].shape, states["a"].dtype) == ((3, 2), torch.bfloat16)
    assert (states["b"].shape, states["b"].dtype) == ((3, 3, 1), torch.float64)
    assert snapshots["b"].shape == (3, 3, 3, 1)
    assert cache.state_bytes_per_slot() == 4 * (2 * 2 + 3 * 8)
    for name in "ab":
        snapshots[name][1, 2] = 7
    cache.commit([1], [3])
    assert (states["a"][1] == 7).all() and (states["b"][1] == 7).all()
    cache.copy_states([1], [0])
    assert (states["b"][0] == 7).all()
    CacheEngine([layer], 1, 4, 2, 0, "cpu", torch.bfloat16)
    assert layer.bound[1] is None  # no speculation, no snapshots


def test_graph_capturability_is_declared_or_assumed():
    class HostSync(nn.Module):
        graph_capturable = False

    assert is_graph_capturable(nn.Linear(2, 2))
    assert not is_graph_capturable(HostSync())
