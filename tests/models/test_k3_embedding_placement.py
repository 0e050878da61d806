"""Where a real tiny Kimi-K3 builds `embed_tokens` under pipeline parallelism.

The last stage holds the table only for an embedding-sharing drafter (DSpark), never
on a context-only producer or a middle stage; and the target forward never runs it.
"""

import pytest
import torch
from safetensors import safe_open

from atom.config import Config
from atom.distributed.parallel_state import build_parallel_state
from atom.model_loader.loader import load_weights
from atom.model_ops.embed_head import VocabParallelEmbedding
from atom.models.kimi.model import KimiK3ForConditionalGeneration, KimiLinearModel
from atom.models.utils import PPMissingLayer
from tests.models.kimi_helpers import (
    EMBEDDING_PLACEMENTS,
    bind_caches,
    forward_rows,
    work,
)

TARGET, DRAFT = "tiny-kimi-k3", "tiny-kimi-k3-dspark"


def k3_config(pp: int, method: str | None = None, kv_role: str = "none") -> Config:
    return Config(
        model=TARGET,
        pipeline_parallel_size=pp,
        method=method,
        draft_model=DRAFT if method else None,
        kv_role=kv_role,
    )


@pytest.mark.parametrize(
    "pp_rank, pp_size, method, kv_role, real", EMBEDDING_PLACEMENTS
)
def test_embedding_placement(pp_rank, pp_size, method, kv_role, real):
    config = k3_config(pp_size, method, kv_role)
    with build_parallel_state(pp_rank=pp_rank, pp_size=pp_size):
        model = KimiLinearModel(config)
    embed = model.embed_tokens
    if real:
        assert isinstance(embed, VocabParallelEmbedding)
        assert tuple(embed.weight.shape) == (4096, 128)
    else:
        assert isinstance(embed, PPMissingLayer)
        assert not list(embed.parameters())
    last = pp_rank == pp_size - 1
    assert isinstance(model.norm, PPMissingLayer) is not last
    assert isinstance(model.output_attn_res_proj, PPMissingLayer) is not last
    owned = [i for i, m in enumerate(model.layers) if not isinstance(m, PPMissingLayer)]
    assert owned == list(range(model.start_layer, model.end_layer))


def test_last_stage_embedding_loads_but_never_runs_in_the_target_forward():
    config = k3_config(2, "dspark")
    with build_parallel_state(pp_rank=1, pp_size=2):
        model = KimiK3ForConditionalGeneration(config)
        load_weights(model, config.model)
        text = model.language_model.model
        name = "language_model.model.embed_tokens.weight"
        shard = "model-00001-of-00002.safetensors"
        with safe_open(f"{config.model}/{shard}", "pt") as f:
            assert torch.equal(text.embed_tokens.weight, f.get_tensor(name))
        calls = []
        text.embed_tokens.register_forward_hook(lambda *args: calls.append(1))
        bind_caches(model)
        payload = model.make_empty_intermediate_tensors(5, torch.float32, "cpu")
        # Layer 4 starts this stage: blocks closed at layers 0 and 2.
        assert tuple(payload["block_residual"].shape) == (5, 2, 128)
        payload["hidden_states"].normal_()
        payload["block_residual"].normal_()
        hidden = forward_rows(model, [work([1, 2, 3, 4, 5], 0)], payload)
    assert calls == []
    assert tuple(hidden.shape) == (5, 128) and torch.isfinite(hidden).all()
