import torch

from atom.model_ops.visibility import block_pass_visibility, causal_visibility


def test_causal_visibility_sees_up_to_the_own_position():
    visible = causal_visibility(torch.tensor([[0, 2]]), 4)
    assert visible.tolist() == [[[True, False, False, False], [True] * 3 + [False]]]


def test_block_pass_sees_its_context_and_the_whole_block():
    visible = block_pass_visibility(torch.tensor([1, 3]), 3, 2)
    context = [[True, False, False], [True, True, True]]
    for b in range(2):
        for t in range(2):
            assert visible[b, t].tolist() == context[b] + [True, True]


def test_a_window_limits_the_context_to_the_last_positions():
    # Block rows at positions 3 and 4 with a window of 2 see context rows from 2 on
    # (row 3) and from 3 on (none of the three context rows for row 4).
    visible = block_pass_visibility(torch.tensor([3]), 3, 2, (2, torch.tensor([3, 4])))
    assert visible[0].tolist() == [
        [False, False, True, True, True],
        [False, False, False, True, True],
    ]
