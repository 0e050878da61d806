"""context_splits.split_keys: a decode kernel's splits share the keys a row sees, in
whole chunks, and together cover them exactly once (interpreted on CPU)."""

import pytest
import torch

from atom.kernels import triton_available
from tests.kernels.devices import DEVICES

triton = pytest.importorskip("triton")
tl = triton.language
split_keys = pytest.importorskip("atom.kernels.context_splits").split_keys


@triton.jit
def ranges_kernel(out_ptr, visible, min_keys, BLOCK_N: tl.constexpr):
    split = tl.program_id(2)
    first, last = split_keys(visible, split, min_keys, BLOCK_N)
    tl.store(out_ptr + 2 * split, first)
    tl.store(out_ptr + 2 * split + 1, last)


def split_ranges(
    visible: int, splits: int, min_keys: int, chunk: int, device: str
) -> list[tuple[int, int]]:
    out = torch.zeros(2 * splits, dtype=torch.int32, device=device)
    ranges_kernel[(1, 1, splits)](out, visible, min_keys, BLOCK_N=chunk)
    values = out.view(splits, 2).tolist()
    return [(first, last) for first, last in values]


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "visible,splits,min_keys", [(320, 16, 1), (320, 2, 256), (5, 4, 1), (1000, 3, 64)]
)
def test_splits_share_the_visible_keys_in_whole_chunks(
    device, visible, splits, min_keys
):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    chunk = 16
    ranges = split_ranges(visible, splits, min_keys, chunk, device)
    covered = [key for first, last in ranges for key in range(first, last)]
    assert covered == list(range(visible))  # every key once, in order
    working = [(first, last) for first, last in ranges if first < last]
    share = max(-(-visible // splits), min_keys)
    share = -(-share // chunk) * chunk
    assert all(first % chunk == 0 for first, _ in working)
    assert all(last - first <= share for first, last in working)
    # A context far shorter than the table still spreads over the splits: 320
    # keys over 16 splits keep 10 programs busy, not one.
    assert len(working) == -(-visible // share)
