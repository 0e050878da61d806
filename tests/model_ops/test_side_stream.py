"""Work run beside the current stream (`atom/model_ops/side_stream.py`): inline on
the CPU; on a GPU forked and joined, eagerly and inside a captured CUDA graph."""

import pytest
import torch

from atom.model_ops.side_stream import Pending, joined, run_beside


def test_on_the_cpu_the_work_runs_inline():
    x = torch.arange(6.0).view(2, 3)
    pending = run_beside(lambda: x * 2, x.device)
    assert isinstance(pending, Pending)
    torch.testing.assert_close(pending.wait(), x * 2)
    torch.testing.assert_close(joined(run_beside(lambda: x + 1, x.device)), x + 1)
    assert joined(None) is None and joined(x) is x


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fork_and_join(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A product on the side stream under a chain of small ops on this one."""
    side = run_beside(lambda: x @ w, x.device)
    main = x
    for _ in range(8):
        main = torch.tanh(main) + 1
    return main @ w + side.wait()


@cuda
def test_the_side_stream_joins_before_its_result_is_read():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, device="cuda", generator=gen)
    w = torch.randn(256, 256, device="cuda", generator=gen)
    expected = torch.tanh(x)
    for _ in range(7):
        expected = torch.tanh(expected + 1)
    expected = (expected + 1) @ w + x @ w
    torch.testing.assert_close(fork_and_join(x, w), expected, rtol=1e-4, atol=1e-3)


def captured(forward, *args: torch.Tensor):
    """(graph, output) of `forward(*args)` captured after an eager warm-up run on a
    stream of its own, as the engine captures its forwards."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        forward(*args)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(*args)
    return graph, out


@cuda
def test_a_captured_graph_replays_the_fork_and_the_join():
    """The fork and the join are the graph's edges: a replay over new inputs gives
    what an eager run over them does."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(64, 256, device="cuda", generator=gen)
    w = torch.randn(256, 256, device="cuda", generator=gen)
    graph, out = captured(fork_and_join, x, w)
    for _ in range(3):
        x.copy_(torch.randn(64, 256, device="cuda", generator=gen))
        graph.replay()
        torch.testing.assert_close(out, fork_and_join(x, w), rtol=1e-5, atol=1e-4)


def two_forks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Two results queued in turn on the side stream, joined in turn: the first
    join waits for the first work only, the second for the rest."""
    first = run_beside(lambda: x @ w, x.device)
    second = run_beside(lambda: torch.tanh(x) @ w, x.device)
    main = first.wait() + 1
    return main @ w + second.wait()


@cuda
def test_forks_join_one_by_one_eagerly_and_in_a_graph():
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(64, 256, device="cuda", generator=gen)
    w = torch.randn(256, 256, device="cuda", generator=gen) / 16
    expected = (x @ w + 1) @ w + torch.tanh(x) @ w
    torch.testing.assert_close(two_forks(x, w), expected, rtol=1e-4, atol=1e-3)
    graph, out = captured(two_forks, x, w)
    x.copy_(torch.randn(64, 256, device="cuda", generator=gen))
    graph.replay()
    torch.testing.assert_close(out, two_forks(x, w), rtol=1e-5, atol=1e-4)
