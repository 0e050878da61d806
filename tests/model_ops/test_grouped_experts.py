"""Routed experts as grouped GEMMs: every path (one `_grouped_mm` kernel, the Triton
grouped GEMM, the unsorted per-pair GEMV, the per-group loop) equals a direct
per-token sum, on CPU (Triton
through its interpreter) and, when present, CUDA in fp32 and bf16."""

import pytest
import torch
import torch.nn.functional as F

from atom.kernels import triton_available
from atom.model_ops.grouped_experts import (
    ExpertChoice,
    _grouped_linear,
    expert_path,
    grouped_expert_mlp,
    grouped_mm_supported,
    routed_mlp,
    step_path,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def direct(x, weights, ids, w13, w2):
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    x, w13, w2 = x.double(), w13.double(), w2.double()
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            y = F.linear(silu_and_mul(F.linear(x[t], w13[e])), w2[e])
            out[t] += weights[t, k].double() * y
    return out


def paths_on(device: str, dtype: torch.dtype) -> list[str]:
    paths = ["loop"]
    if grouped_mm_supported(torch.device(device), dtype, 32, 16):
        paths.append("grouped_mm")
    if triton_available(device):
        paths += ["triton", "gemv"]
    return paths


CASES = [
    (device, dtype, path)
    for device in DEVICES
    for dtype in ([torch.float32] + ([torch.bfloat16] if device == "cuda" else []))
    for path in paths_on(device, dtype)
]


@pytest.mark.kernels
@pytest.mark.parametrize("device,dtype,path", CASES)
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_every_expert_path_equals_the_direct_sum(device, dtype, path, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    # Widths that are not multiples of the Triton tiles exercise the masks.
    experts, hidden, inner, top_k = 8, 48, 24, 3
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inner, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inner, generator=gen) / inner**0.5
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in x])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    expected = direct(x.to(dtype), weights, ids, w13.to(dtype), w2.to(dtype))
    args = [
        t.to(device) for t in (x.to(dtype), weights, ids, w13.to(dtype), w2.to(dtype))
    ]
    x_d, weights_d, ids_d, w13_d, w2_d = args
    choice = ExpertChoice(weights_d, ids_d)
    out = grouped_expert_mlp(x_d, choice, w13_d, w2_d, silu_and_mul, path)
    assert out.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


@pytest.mark.kernels
def test_both_products_of_an_expert_mlp_read_one_tile_list():
    """The Triton products over one step's groups build the tile list once."""
    if not triton_available("cpu"):
        pytest.skip("triton cannot run here")
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inner, top_k, tokens = 6, 40, 24, 2, 5
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inner, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inner, generator=gen) / inner**0.5
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in x])
    weights = torch.rand(tokens, top_k, generator=gen)
    seen = []

    def product(weight):
        def run(rows, groups, row_source):
            out = _grouped_linear(rows, weight, groups, "triton", row_source)
            seen.append((groups, dict(groups.tile_lists)))
            return out

        return run

    up = product(w13)
    gated_up = lambda *args: silu_and_mul(up(*args))  # noqa: E731
    out = routed_mlp(x, ExpertChoice(weights, ids), experts, gated_up, product(w2))
    (groups_up, lists_up), (groups_down, lists_down) = seen
    assert groups_up is groups_down and len(lists_up) == 1
    ((height, tile_list),) = lists_up.items()
    assert lists_down[height] is tile_list
    torch.testing.assert_close(
        out.double(), direct(x, weights, ids, w13, w2), atol=1e-4, rtol=1e-4
    )


def test_misaligned_widths_fall_back_to_the_loop():
    assert not grouped_mm_supported(torch.device("cpu"), torch.float32, 30, 16)
    assert not grouped_mm_supported(torch.device("cpu"), torch.bfloat16, 12)
    w13, w2 = torch.zeros(4, 30, 15), torch.zeros(4, 15, 15)
    assert expert_path(w13, w2) == "loop"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_experts_take_a_capturable_path_in_every_dtype(dtype):
    """fp32 `_grouped_mm` copies host<->device on CUDA (torch 2.11), which broke
    graph capture of every fp32 model: CUDA routes it to a capturable path, and a
    graph of the whole expert MLP replays the eager result."""
    w13 = torch.randn(8, 48, 64, device="cuda", dtype=dtype) / 8
    w2 = torch.randn(8, 64, 24, device="cuda", dtype=dtype) / 5
    path = expert_path(w13, w2)
    assert path in ("grouped_mm", "triton")
    if dtype != torch.bfloat16:
        assert path == "triton"
    x = torch.randn(6, 64, device="cuda", dtype=dtype)
    ids = torch.randint(0, 8, (6, 2), device="cuda")
    weights = torch.rand(6, 2, device="cuda")
    choice = ExpertChoice(weights, ids)
    eager = grouped_expert_mlp(x, choice, w13, w2, silu_and_mul, path)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_expert_mlp(x, choice, w13, w2, silu_and_mul, path)
    graph.replay()
    torch.testing.assert_close(captured, eager)


def test_decode_sized_cuda_steps_take_triton_where_grouped_mm_runs():
    cpu = torch.device("cpu")
    assert step_path("grouped_mm", 8, cpu) == "grouped_mm"
    assert step_path("loop", 8, cpu) == "loop"
    if torch.cuda.is_available() and triton_available("cuda"):
        cuda = torch.device("cuda")
        assert step_path("grouped_mm", 8, cuda) == "triton"  # gemv is off
        assert step_path("triton", 8, cuda) == "triton"
        assert step_path("grouped_mm", 1024, cuda) == "triton"
        assert step_path("grouped_mm", 1025, cuda) == "grouped_mm"  # prefill
        assert step_path("triton", 5000, cuda) == "triton"
        assert step_path("loop", 8, cuda) == "loop"
