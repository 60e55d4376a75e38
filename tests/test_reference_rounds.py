"""One round's arithmetic in the reference: acceptance, commit, stop rule, EQSPEC update."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from specbatch.reference import RectState, commit_counts, eqspec_update, greedy_accept, realign_source


def test_greedy_accept_stops_at_first_mismatch_and_at_the_row_limit():
    drafted = np.array([[1, 2, 3], [1, 9, 3], [7, 2, 3], [1, 2, 3]])
    choice = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    assert greedy_accept(drafted, choice, np.array([3, 3, 3, 1])).tolist() == [3, 1, 0, 1]


def test_commit_counts_bonus_eos_and_budget():
    choice = np.array([[5, 6, 7, 8], [5, 0, 7, 8], [5, 6, 7, 8], [0, 6, 0, 8]])
    accepted = np.array([3, 3, 3, 2])
    n, eos = commit_counts(choice, accepted, remaining=np.array([9, 9, 2, 9]), eos_ids={0})
    # full accept -> 4 tokens with bonus; EOS at index 1 -> 2 tokens; budget 2 -> 2; first EOS at 0
    assert n.tolist() == [4, 2, 2, 1]
    assert eos.tolist() == [False, True, False, True]


def test_eos_after_the_committed_tokens_is_ignored():
    n, eos = commit_counts(np.array([[5, 6, 0]]), np.array([1]), np.array([9]), eos_ids={0})
    assert n.tolist() == [2] and not eos[0]


rows_st = st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=12), min_size=1, max_size=8)


@given(rows_st, st.data())
def test_eqspec_update_keeps_alignment_and_equals_one_gather(rows, data):
    """Theorem B.1: unpad/append/repad equals one gather by δ; I1 holds after the update."""
    state = RectState.from_rows(rows, pad_id=0)
    k = data.draw(st.integers(0, 5))
    n = np.array(data.draw(st.lists(st.integers(1, k + 1), min_size=len(rows), max_size=len(rows))))
    new_tokens = np.array(data.draw(st.lists(st.lists(st.integers(0, 9), min_size=k + 1, max_size=k + 1),
                                             min_size=len(rows), max_size=len(rows))))
    new_state, delta = eqspec_update(state, new_tokens, n)
    assert (new_state.pad_len + new_state.content_len == new_state.width).all()  # I1
    assert new_state.width == (state.content_len + n).max()
    extended = np.concatenate([state.tokens, new_tokens], axis=1)
    source = realign_source(state.pad_len, n, state.width, new_state.width)
    gathered = np.where(source >= 0, np.take_along_axis(extended, np.maximum(source, 0), axis=1), -1)
    for i in range(len(rows)):
        content = gathered[i, new_state.pad_len[i]:]
        assert content.tolist() == rows[i] + new_tokens[i, :n[i]].tolist()
        assert (gathered[i, :new_state.pad_len[i]] == -1).all()
    assert (delta == new_state.pad_len - state.pad_len).all()
    if len(set(n.tolist())) == 1:
        assert (delta == 0).all()


def test_masks_come_from_lengths_not_token_values():
    state = RectState.from_rows([[0, 0, 3], [0]], pad_id=0)  # pad id inside content
    assert state.attention_mask().tolist() == [[True, True, True], [False, False, True]]
    assert state.position_ids(np.arange(3)).tolist() == [[0, 1, 2], [0, 0, 0]]
