"""Invariant checkers (I1-I7, S1-S4) and the trace format; usable by any engine.

Checkers accept NumPy arrays or torch tensors and return lists of `Violation`s.
"""
from .checks import (allowed_from_mask, check_alignment, check_composition, check_conservation, check_kv,
                     check_liveness, check_mask, check_order, check_outputs, check_packed_forward, check_positions, check_proposal_lengths,
                     check_distinct_candidates, check_goodput_leaves, check_goodput_lengths, check_round_commit, check_stop, check_threshold_leaves, check_tree_commit,
                     check_tree_forward,
                     expected_visibility)
from .trace import TraceError, TraceWriter, check_trace, mask_strings, read_trace
from .violations import InvariantError, Violation, as_numpy, raise_if

__all__ = [
    "Violation", "InvariantError", "raise_if", "as_numpy", "allowed_from_mask", "expected_visibility",
    "check_alignment", "check_positions", "check_mask", "check_packed_forward", "check_tree_forward", "check_tree_commit", "check_proposal_lengths",
    "check_goodput_lengths", "check_goodput_leaves", "check_threshold_leaves", "check_distinct_candidates", "check_kv", "check_round_commit", "check_stop",
    "check_outputs", "check_conservation", "check_order", "check_liveness", "check_composition",
    "TraceWriter", "TraceError", "check_trace", "read_trace", "mask_strings",
]
