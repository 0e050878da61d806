import pytest
import torch

from atom.config import KDA_BACKEND_ENV_VAR, Config
from atom.model_engine.batch import SeqWork
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_ops.kda import chunk_kda, l2_normalize, recurrent_kda
from atom.model_ops.kda_backend import (
    StateSlots,
    TorchKDABackend,
    fla_available,
    select_kda_backend,
)
from atom.models.kimi.kda import KimiDeltaAttention
from atom.models.registry import get_model_class
from atom.utils.forward_context import AttentionMetadata


def test_cpu_gets_torch_backend():
    assert isinstance(select_kda_backend("cpu"), TorchKDABackend)
    assert select_kda_backend(torch.device("cpu"), "torch").name == "torch"


def test_fla_request_on_cpu_is_an_error():
    with pytest.raises(ValueError, match="CUDA"):
        select_kda_backend("cpu", "fla")


def test_unknown_backend_names_allowed_values():
    with pytest.raises(ValueError, match="auto"):
        select_kda_backend("cpu", choice="cuda")


def test_config_resolves_the_backend_from_the_environment(monkeypatch):
    monkeypatch.delenv(KDA_BACKEND_ENV_VAR, raising=False)
    assert Config(model="tiny-kimi-linear").kda_backend == "auto"
    monkeypatch.setenv(KDA_BACKEND_ENV_VAR, "Torch")
    config = Config(model="tiny-kimi-linear")
    assert config.kda_backend == "torch"
    assert "KDA backend torch" in config.describe_settings()
    assert Config(model="tiny-kimi-linear", kda_backend="fla").kda_backend == "fla"
    monkeypatch.setenv(KDA_BACKEND_ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=f"{KDA_BACKEND_ENV_VAR}.*'cuda'.*torch"):
        Config(model="tiny-kimi-linear")


def test_every_kda_layer_gets_the_configured_backend():
    config = Config(model="tiny-kimi-linear", kda_backend="torch")
    model = get_model_class(config.hf_config.architecture)(config)
    layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    assert layers and {layer.backend_choice for layer in layers} == {"torch"}


def uniform_metadata(num_seqs: int, rows: int, device: str) -> AttentionMetadata:
    """Metadata of `num_seqs` fresh sequences of `rows` rows each (what fla reads)."""
    works = [
        SeqWork(
            seq_id=i, token_ids=[0] * rows, context_len=0, block_table=[0], state_slot=i
        )
        for i in range(num_seqs)
    ]
    return prepare_inputs(works, rows, device)[2]


def test_torch_backend_runs_chunked_prefill_and_token_decode():
    gen = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(2, 9, 2, 8, generator=gen))
    k = l2_normalize(torch.randn(2, 9, 2, 8, generator=gen))
    v = torch.randn(2, 9, 2, 4, generator=gen)
    g = -torch.rand(2, 9, 2, 8, generator=gen)
    beta = torch.rand(2, 9, 2, generator=gen)
    state = torch.randn(2, 2, 4, 8, generator=gen)
    backend = select_kda_backend("cpu", choice="torch")
    metadata = uniform_metadata(2, 9, "cpu")
    o, final = backend.prefill(q, k, v, g, beta, state, metadata)
    o_ref, final_ref = chunk_kda(q, k, v, g, beta, state)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
    # Decode works in the pool: slots 3 and 1 of 4, the first sequence fresh.
    pool = torch.randn(4, 2, 4, 8, generator=gen)
    snapshots = torch.zeros(4, 9, 2, 4, 8)
    slots, context_lens = torch.tensor([3, 1]), torch.tensor([0, 7], dtype=torch.int32)
    start = torch.stack([torch.zeros(2, 4, 8), pool[1]])
    o_ref, final_ref, rows_ref = recurrent_kda(
        q, k, v, g, beta, start, return_all_states=True
    )
    o = backend.decode(
        q, k, v, g, beta, StateSlots(pool, slots, context_lens, snapshots)
    )
    assert torch.equal(o, o_ref) and torch.equal(pool[slots], final_ref)
    assert torch.equal(snapshots[slots], rows_ref)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla"
)
def test_fla_backend_matches_torch_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    # tiny-kimi-k3's KDA widths: fla's first call at a width costs about 80 s of
    # Triton autotuning on an H200, which the CUDA graph tests then reuse.
    seqs, tokens, heads, dim = 3, 150, 4, 32

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q = l2_normalize(randn(seqs, tokens, heads, dim))
    k = l2_normalize(randn(seqs, tokens, heads, dim))
    v = randn(seqs, tokens, heads, dim)
    g = -5.0 * torch.sigmoid(randn(seqs, tokens, heads, dim))
    beta = torch.sigmoid(randn(seqs, tokens, heads))
    state = randn(seqs, heads, dim, dim) * 0.1
    fla = select_kda_backend("cuda", choice="fla")
    reference = select_kda_backend("cuda", choice="torch")
    metadata = uniform_metadata(seqs, tokens, "cuda")
    o, final = fla.prefill(q, k, v, g, beta, state, metadata)
    o_ref, final_ref = reference.prefill(q, k, v, g, beta, state, metadata)
    torch.testing.assert_close(o, o_ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(final, final_ref, rtol=2e-3, atol=2e-3)
    one = (slice(None), slice(None, 1))
    pools = [state.clone(), state.clone()]
    slots = torch.arange(seqs, device="cuda")
    context_lens = torch.full((seqs,), 5, dtype=torch.int32, device="cuda")
    o, o_ref = (
        backend.decode(
            q[one],
            k[one],
            v[one],
            g[one],
            beta[one],
            StateSlots(pool, slots, context_lens),
        )
        for backend, pool in zip((fla, reference), pools)
    )
    torch.testing.assert_close(o, o_ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(pools[0], pools[1], rtol=2e-3, atol=2e-3)
