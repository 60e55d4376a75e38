"""The checkers on hand-made inputs, NumPy and torch alike, and their messages."""
import numpy as np
import pytest
import torch

from specbatch.invariants import (InvariantError, Violation, check_alignment, check_conservation, check_kv,
                                  check_mask, check_order, check_positions, check_stop, raise_if)


@pytest.mark.parametrize("to", [np.asarray, torch.as_tensor])
def test_alignment_and_positions(to):
    assert check_alignment(to([2, 0]), to([3, 5]), 5) == []
    (v,) = check_alignment(to([2, 1]), to([3, 5]), 5)
    assert (v.invariant, v.row, v.expected, v.actual) == ("I1", 1, 5, 6)
    (v,) = check_positions(to([[0, 3, 3]]), to([[-1, 3, 4]]))  # pad query not checked
    assert (v.invariant, v.index, v.actual) == ("I2", 4, 3)


def test_mask_accepts_additive_float_masks_and_reports_the_slot():
    query, slots = np.array([[1]]), np.array([[-1, 0, 1, 2]])  # slot 0 is padding, slot 3 a future token
    good = torch.tensor([[[[-1e30, 0.0, 0.0, -1e30]]]])
    assert check_mask(good, query, slots) == []
    leaky = good.clone()
    leaky[..., 0] = 0.0
    (v,) = check_mask(leaky, query, slots)
    assert (v.invariant, v.index, v.expected, v.actual) == ("I4", 0, False, True)
    windowed = np.array([[[False, False, True, False]]])  # window 1: only itself
    assert check_mask(windowed, query, slots, window=1) == []


def test_kv_compares_with_a_fresh_recomputation():
    fresh = np.arange(12.0).reshape(3, 4)
    keys = np.zeros((1, 5, 4))
    keys[0, 2:] = fresh  # two pad slots
    slots = np.array([[-2, -1, 0, 1, 2]])
    assert check_kv(keys, slots, [3], lambda i: fresh) == []
    keys[0, 3, 1] += 1.0
    (v,) = check_kv(keys, slots, [3], lambda i: fresh)
    assert (v.invariant, v.index) == ("I3", 1)


def test_stop_order_and_conservation():
    assert check_stop([4, 5, 0], {0}, 8) == []
    assert check_stop([4, 5, 6], {0}, 3) == []
    assert [v.invariant for v in check_stop([4, 0, 6], {0}, 8)] == ["I6"]
    assert [v.invariant for v in check_stop([4, 5], {0}, 3)] == ["I6"]
    assert check_order([0, 1, 2], [0, 1, 2]) == []
    assert check_order([1, 0, 2], [0, 1, 2])[0].index == 0
    members = {"queue": [3], "pool": [1], "running": [0], "done": [2, 1]}
    (v,) = check_conservation(range(4), members)
    assert (v.invariant, v.row, v.actual) == ("S1", 1, 2)


def test_violation_message_names_invariant_round_row_and_index():
    v = Violation("I4", "query 3 sees a slot it must not (slot 0)", row=2, index=0, expected=False, actual=True)
    with pytest.raises(InvariantError) as caught:
        raise_if([v], round_=7)
    assert str(caught.value) == ("I4 violated (round 7, row 2, index 0): query 3 sees a slot it must not (slot 0); "
                                 "expected False, got True")
