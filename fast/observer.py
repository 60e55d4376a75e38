"""What watches a generation's rounds (check_invariants=True, trace=PATH), behind one object.

The strategies report to `settings.observer` and never ask whether anyone listens:

    check(violations)    violations() -> the violations of what just happened (I1-I4 of a forward,
                         I3 of the caches, S1); called at once, and only by a checker
    round(...)           one round's proposals and commits (I5-I7), its rows and queries (trace rows)
    end_round(index)     the round (0: an admission's prefill) is over

Inputs that cost device work or host copies are passed as functions (`violations`, `rows`,
`queries`), so an engine that nobody watches pays only the calls. Implementations:

    Observer          watches nothing (the default)
    InvariantChecker  collects violations during a round, raises them at its end (InvariantError)
    TraceRecorder     one trace row per row per round (invariants.trace)
    Observers         several at once (observer_for builds what generate's arguments ask for)
"""
from __future__ import annotations

import numpy as np

from ..invariants import check_distinct_candidates, check_round_commit, check_tree_commit, mask_strings, raise_if
from .verify import committed_lists


class Observer:
    """Watches nothing."""

    def check(self, violations) -> None:
        pass

    def round(self, settings, round_index: int, rows: dict, queries, proposals, choice, accepted, n, remaining,
              finished, stopped=None, tree=None) -> None:
        """rows() -> requests, prompt_len, tokens, pad_len and content_len of the round's rows (host or
        device); queries() -> per row, the position ids [Q_i] and visible slots [Q_i, S] (bool) of its own verify
        queries, as host arrays; stopped [R]: the rows a stop string ended; tree() -> (parents per row,
        node tokens [R, W], node choices [R, W] (None under rejection sampling), accepted path [R, P])
        of a tree round (fast.trees), whose choice [R, P + 1] holds the tokens along root + path and
        the one after it."""

    def end_round(self, round_index: int) -> None:
        pass


class InvariantChecker(Observer):
    """check_invariants=True: every violation reported during a round, raised at its end."""

    def __init__(self):
        self.found: list = []

    def check(self, violations) -> None:
        self.found += violations()

    def round(self, settings, round_index, rows, queries, proposals, choice, accepted, n, remaining, finished,
              stopped=None, tree=None) -> None:
        """I5 and I6 of the commit (a tree round's against its tree), I7 of the proposals."""
        if tree is not None:
            parents, node_tokens, node_choice, path = tree()
            self.found += check_tree_commit(parents, node_tokens, node_choice, accepted, committed_lists(choice, n),
                                            remaining, settings.eos_ids, stopped, path, choice.cpu().numpy())
        else:
            drafted = proposals.drafted.cpu().numpy()[:, :proposals.width - 1]
            self.found += check_round_commit(drafted, choice.cpu().numpy(), proposals.proposed, accepted,
                                             committed_lists(choice, n), remaining, settings.eos_ids, stopped)
        self.found += check_proposals(proposals)

    def end_round(self, round_index: int) -> None:
        found, self.found = self.found, []
        raise_if(found, round_index)


class TraceRecorder(Observer):
    """trace=PATH: each round's rows as invariants.trace rows, through a TraceWriter."""

    def __init__(self, writer):
        self.writer = writer

    def round(self, settings, round_index, rows, queries, proposals, choice, accepted, n, remaining, finished,
              stopped=None, tree=None) -> None:
        p, committed, shown = proposals.proposed, committed_lists(choice, n), queries()
        drafted, host_choice = proposals.drafted.cpu().numpy(), choice.cpu().numpy()
        confidence = (proposals.confidence.float().cpu().numpy() if proposals.confidence is not None
                      else np.zeros((len(p), 0)))
        rows = rows()
        tokens = rows["tokens"].cpu().numpy()
        self.writer.round(round_index, [dict(
            request=int(rows["requests"][i]), prompt_len=int(rows["prompt_len"][i]), tokens=tokens[i].tolist(),
            pad_len=int(rows["pad_len"][i]), content_len=int(rows["content_len"][i]),
            positions=[int(x) for x in shown[i][0]], mask=mask_strings(shown[i][1]),
            drafted=drafted[i, :p[i]].tolist(), target_argmax=host_choice[i, :p[i] + 1].tolist(),
            draft_limit=int(p[i]), cap=int(proposals.limit[i]), limit=int(proposals.limit[i]),
            **proposals.rule.fields(i),
            draft_confidence=[float(c) for c in confidence[i]], accepted=int(accepted[i]),
            committed=list(committed[i]), finished=bool(finished[i])) for i in range(len(p))])


class Observers(Observer):
    """Several observers, each told everything in order."""

    def __init__(self, *observers: Observer):
        self.observers = observers

    def check(self, violations) -> None:
        for o in self.observers:
            o.check(violations)

    def round(self, *args, **kwargs) -> None:
        for o in self.observers:
            o.round(*args, **kwargs)

    def end_round(self, round_index: int) -> None:
        for o in self.observers:
            o.end_round(round_index)


def observer_for(check_invariants: bool, trace_writer=None) -> Observer:
    """The observer generate's check_invariants and trace arguments ask for."""
    chosen = ([InvariantChecker()] if check_invariants else []) + ([TraceRecorder(trace_writer)] if trace_writer else [])
    return chosen[0] if len(chosen) == 1 else Observers(*chosen) if chosen else Observer()


def check_proposals(proposals) -> list:
    """I7: every row's proposal length (and a tree's leaves under each proposal) is the rule's, from
    its own confidences and limit."""
    confidence = (proposals.confidence.float().cpu().numpy() if proposals.confidence is not None
                  else np.zeros((len(proposals.limit), 0)))
    found = proposals.rule.check(proposals.proposed, confidence)
    if proposals.leaves is not None:  # a tree round: each step's leaves are the rule's too
        found += proposals.rule.check_leaves(proposals.leaves, proposals.runner_ups, confidence, proposals.proposed,
                                             proposals.available)
        if proposals.q is None:  # greedy, coupled: a node's children carry distinct tokens
            found += check_distinct_candidates(proposals.drafted.cpu().numpy(), proposals.siblings.cpu().numpy(),
                                               proposals.leaves, proposals.siblings.shape[2])
    return found
