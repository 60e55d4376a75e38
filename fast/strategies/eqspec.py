"""EQSPEC: a left-padded rectangular batch, realigned after every round (unpad, append, repad).

State per batch: token ids [B, L] and per-row content lengths (pad_len = L - content_len, I1),
the target cache covering columns [0, L - 1) (the pending token is column L - 1 for every row),
and the draft's side (fast.rect_proposer: its cache covers [0, L - P), P = the largest draft
pending count, 1, or 2 after a full accept). A round is: draft k tokens, verify k + 1 in one target
forward, accept, commit, realign with one gather per cache tensor (or a crop when every row
committed the same count).
"""
from __future__ import annotations

import numpy as np
import torch

from ..compute.cache import gather_cache, rect_inputs
from ..compute.prefill import prefill_rectangle
from ...invariants import check_alignment
from ...reference.pool import FixedBatches
from ..engine import (Arrivals, Settings, Stats, check_cache_row, check_rect_forward, dynamic_layer_kv, rect_queries,
                      record_round)
from ..processors import STOP, STOP_REASONS
from ..rect_proposer import rect_proposer_class
from ..verify import commit_counts


class RectBatch:
    def __init__(self, target, settings: Settings, stats: Stats, clock, *, request, prompt_len, content_len,
                 budget_end, tokens, target_cache, proposer, rounds=None):
        self.target, self.settings, self.stats, self.clock = target, settings, stats, clock
        self.request, self.prompt_len, self.content_len = request, prompt_len, content_len
        self.rounds = np.zeros(len(request), dtype=np.int64) if rounds is None else rounds  # rounds each row ran
        self.budget_end, self.tokens = budget_end, tokens
        self.target_cache, self.proposer = target_cache, proposer  # proposer: the draft's side (fast.rect_proposer)

    @classmethod
    def prefill(cls, prompts, requests, max_new, target, draft, settings: Settings, stats: Stats, clock):
        """A new batch: left-pad the prompts and prefill both caches on everything but the pending token
        (fast.compute.prefill: the real tokens only, written at their left-padded columns)."""
        prompt_len = np.array([len(p) for p in prompts])
        width = int(prompt_len.max())
        tokens = torch.tensor([[settings.pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long,
                              device=settings.device)
        with clock("time_prefill"):  # real tokens only, packed; the caches come out left-padded (I1)
            contents = [list(p)[:-1] for p in prompts]
            target_cache = prefill_rectangle(target, contents, width - 1, settings)
            proposer = rect_proposer_class(draft).prefilled(draft, settings, contents, width - 1)
        settings.observer.end_round(0)
        return cls(target, settings, stats, clock, request=np.asarray(requests), prompt_len=prompt_len,
                   content_len=prompt_len.copy(), budget_end=prompt_len + np.asarray(max_new), tokens=tokens,
                   target_cache=target_cache, proposer=proposer)

    @property
    def size(self) -> int:
        return len(self.request)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def pad_len_t(self) -> torch.Tensor:
        return torch.as_tensor(self.width - self.content_len, device=self.settings.device)

    def forward(self, runner, ids, first_col, cache, last_only=False):
        """runner's logits for the query columns first_col.. of every row, with the positions and mask used."""
        s = self.settings
        pos, mask = rect_inputs(self.pad_len_t, first_col, ids.shape[1], s.window, s.dtype, s.fill)
        s.observer.check(lambda: check_rect_forward(self.pad_len_t, first_col, pos, mask, s.window))
        return runner(ids, pos, mask, cache, last_only=last_only), pos, mask

    def round(self, round_index: int) -> list[tuple[int, list[int], str, int]]:
        """One round; returns (request, new tokens, stop reason, rounds) of the rows that finished."""
        s, width = self.settings, self.width
        self.rounds += 1
        remaining = self.budget_end - self.content_len
        clamp = np.minimum(s.k, remaining - 1)
        s.observer.check(lambda: check_alignment(width - self.content_len, self.content_len, width))

        dev = lambda a: torch.as_tensor(a, device=s.device)  # noqa: E731
        requests, content = dev(self.request), dev(self.content_len)
        with self.clock("time_draft"):
            draft_forward = lambda runner, ids, first_col, cache: self.forward(  # noqa: E731
                runner, ids, first_col, cache, last_only=True)[0]
            proposals = self.proposer.propose(draft_forward, self.tokens, clamp, requests, content)
        p, q = proposals.proposed, proposals.q
        drafted = proposals.drafted[:, :proposals.width - 1]  # longer rows' proposals; shorter rows never accept them

        with self.clock("time_verify"):
            ids = torch.cat([self.tokens[:, -1:], drafted], dim=1)
            logits, pos, mask = self.forward(self.target, ids, width - 1, self.target_cache)
            choice, accepted_t = s.chooser.verify(logits, drafted, None if q is None else q[:, :drafted.shape[1]],
                                                  dev(p), requests, content)
            n_t, hit_t = commit_counts(choice, accepted_t, dev(remaining), s.eos)
            accepted, n, hit_eos = torch.stack([accepted_t, n_t, hit_t.long()]).cpu().numpy()  # one sync a round
            if s.processors is not None:  # stop strings, and the history penalties count
                n, hit_eos = s.processors.finish_round(requests, choice, n, hit_eos)
        finished = (hit_eos > 0) | (n == remaining)
        record_round(s, self.clock, self.request, proposals, accepted, ids.numel())

        with self.clock("time_align"):
            extended = torch.cat([self.tokens, choice], dim=1)  # committed token j of a row is column width + j
            done = self._collect_finished(extended, finished, n, hit_eos)
            s.observer.round(s, round_index, lambda: dict(requests=self.request, prompt_len=self.prompt_len,
                                                          tokens=self.tokens, pad_len=width - self.content_len,
                                                          content_len=self.content_len),
                             lambda: rect_queries(pos, mask, p), proposals, choice, accepted, n, remaining, finished,
                             hit_eos == STOP)
            self._update(extended, ~finished, n, accepted, proposals)
        self.stats.add_round(p, accepted, n)
        s.observer.check(lambda: self._check_caches(round_index))
        s.observer.end_round(round_index)
        return done

    def _collect_finished(self, extended, finished, n, hit_eos):
        rows = np.nonzero(finished)[0]
        if len(rows) == 0:
            return []
        host = extended[torch.as_tensor(rows, device=extended.device)].cpu().numpy()
        start = self.width - self.content_len[rows] + self.prompt_len[rows]
        end = self.width + n[rows]
        return [(int(self.request[r]), host[j, start[j]:end[j]].tolist(), STOP_REASONS[int(hit_eos[r])],
                 int(self.rounds[r])) for j, r in enumerate(rows)]

    def _update(self, extended, keep, n, accepted, proposals):
        """The EQSPEC update on tokens and both caches: one gather each, or a crop when δ = 0."""
        new_len = self.content_len + n
        if not keep.any():
            self.request = self.request[:0]
            return
        new_width = int(new_len[keep].max())
        delta = new_width - self.width - n[keep]  # δ_i = L' - L - n_i (Theorem B.1)
        rows = None if keep.all() else torch.as_tensor(np.nonzero(keep)[0], device=self.settings.device)
        if rows is None and not delta.any():
            source = None
            self.tokens = extended[:, :new_width]
        else:
            source = (torch.arange(new_width, device=self.settings.device)[None, :]
                      - torch.as_tensor(delta, device=self.settings.device)[:, None]).clamp(min=0)
            kept = extended if rows is None else extended[rows]
            self.tokens = kept.gather(1, source)
        gather_cache(self.target_cache, rows, source, new_width - 1)
        self.proposer.realign(self.width, n, accepted, proposals, keep, rows, source, new_width)
        self.request, self.prompt_len, self.budget_end = self.request[keep], self.prompt_len[keep], self.budget_end[keep]
        self.content_len, self.rounds = new_len[keep], self.rounds[keep]

    def _check_caches(self, round_index):
        """I3 on one sampled row per round (round robin), target and draft, by unpadded recomputation."""
        if self.size == 0:
            return []
        row = round_index % self.size
        pad = self.width - int(self.content_len[row])
        content = self.tokens[row, pad:].tolist()
        found = check_cache_row(self.target, dynamic_layer_kv(self.target_cache, row), row, content[:-1], pad,
                                self.settings, "target cache")
        return found + self.proposer.check_cache(row, content, pad)


class Eqspec:
    """EQSPEC over all requests: fixed batches of up to `batch_size` requests in arrival (input)
    order; a finished row leaves its batch at once (no zombie rows)."""
    layout = "rectangular"
    keeps_features = False
    batch_class = RectBatch  # a deliberately broken subclass in strategies.broken

    def __init__(self, options=None):
        pass

    def run(self, target, draft, prompts, max_new, settings: Settings, stats: Stats, clock, batch_size: int, on_done):
        arrivals = settings.arrivals or Arrivals(len(prompts))
        batches = FixedBatches(batch_size)  # the reference's scheduler (reference.pool)
        round_index = 0
        while arrivals.pending() or batches.queue:
            for r in arrivals.due():
                batches.submit(r)
            if not batches.queue:
                arrivals.wait()
                continue
            requests = batches.next_batch()
            batch = self.batch_class.prefill([prompts[r] for r in requests], requests, [max_new[r] for r in requests],
                                             target, draft, settings, stats, clock)
            while batch.size:
                round_index += 1
                finished = []
                for done in batch.round(round_index):
                    on_done(*done)
                    finished.append(done[0])
                batches.finish(finished)
