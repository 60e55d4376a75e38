"""Sampling in NumPy: the two verification steps and the exact one-round output distribution.

rejection_step: accept draft d_j while u_j * q_j(d_j) < p_j(d_j) (at most `limit` drafts); the next
token comes from norm(max(0, p - q)) after a reject, else from p. coupled_step: with one Gumbel
vector per position, target choice = argmax(log p + g); drafts are accepted while equal.
"""
from __future__ import annotations

import numpy as np


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p


def one_round_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Distribution of the first committed token when one draft d ~ q is verified against p:
    q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) residual(x), which is exactly p."""
    accept = np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 1.0)
    kept = q * accept
    return kept + (1.0 - kept.sum()) * residual(p, q)


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    return int(min(np.searchsorted(np.cumsum(probs), u), len(probs) - 1))


def rejection_step(p: np.ndarray, q: np.ndarray, drafted, limit: int, u_accept, u_sample: float):
    """p: [k+1, V], q: [k, V]. Returns (accepted, committed tokens before the stop rule)."""
    accepted = 0
    while accepted < limit and u_accept[accepted] * q[accepted, drafted[accepted]] < p[accepted, drafted[accepted]]:
        accepted += 1
    if accepted < limit:
        dist = residual(p[accepted], q[accepted])
    else:
        dist = p[accepted]
    return accepted, list(drafted[:accepted]) + [inverse_cdf(dist, u_sample)]


def coupled_step(log_p: np.ndarray, gumbel: np.ndarray, drafted, limit: int):
    """log_p: [k+1, V], gumbel: [k+1, V] (per position). Returns (accepted, committed tokens)."""
    choice = np.argmax(log_p + gumbel, axis=-1)
    accepted = 0
    while accepted < limit and drafted[accepted] == choice[accepted]:
        accepted += 1
    return accepted, choice[:accepted + 1].tolist()
