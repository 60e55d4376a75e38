"""The flat verify layout (fast.layout.VerifyLayout): each row's pending token and own proposals end
to end, at content indices c_i - 1 .. c_i - 1 + p_i, from the lengths alone."""
import numpy as np

from specbatch.fast.layout import VerifyLayout


def test_rows_are_laid_end_to_end_at_their_own_content_indices():
    layout = VerifyLayout.of(proposed=[2, 0, 1], content=[5, 3, 7])
    assert layout.tokens == 6 and layout.start.tolist() == [0, 3, 4]
    assert layout.token_row.tolist() == [0, 0, 0, 1, 2, 2]
    assert layout.column.tolist() == [0, 1, 2, 0, 0, 1]
    assert layout.token_index.tolist() == [4, 5, 6, 2, 6, 7]
    assert layout.gather.tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 5]]  # clamped to each row's last query
    assert layout.query_index(np.array([2, 1]), 3).tolist() == [[6, 7, -1], [2, -1, -1]]


def test_a_round_without_proposals_is_one_query_per_row():
    layout = VerifyLayout.of(proposed=[0, 0], content=[1, 9])
    assert layout.token_index.tolist() == [0, 8] and layout.gather.tolist() == [[0], [1]]
