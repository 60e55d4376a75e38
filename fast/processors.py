"""Logit processors and stop strings for a batch of requests (twin of reference.processors).

`LogitProcessors` holds each request's settings and the tokens it has generated, and processes the
target's verify logits [R, W, V] so that query j of a row sees the prefix that choosing its token
would extend: the committed tokens and the row's drafts d_0 .. d_{j-1}. That is what makes a
speculative round equal to one-token-at-a-time decoding with the same processors: a draft is
accepted only where its whole prefix is accepted, so the processed logits of every accepted
position are those target-only decoding computes (proofs_notes/sampling.md#processors).

Per round: `verify_logits` (steps 1-4 of reference.processors, float64), then, once the round's
counts n are known, `finish_round`, which cuts rows at a completed stop string (hit code STOP) and
appends the committed tokens to each request's history. Counts are rebuilt from the history every
round ([R, V], never [requests, V]), so memory does not grow with the number of requests.
"""
from __future__ import annotations

import torch

from ..reference.processors import Processors, stop_cut

EOS, STOP = 1, 2  # hit codes of a finished row besides 0 (budget); STOP_REASONS maps them to names
STOP_REASONS = {0: "length", EOS: "eos", STOP: "stop"}


class LogitProcessors:
    """Settings [N] per request and the history of their new tokens; see the module docstring."""

    def __init__(self, settings: list[Processors], prompts, max_new, eos_ids, device, decode=None):
        n = len(settings)
        self.settings, self.decode, self.device = settings, decode, device
        as_t = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
        self.repetition = as_t([s.repetition_penalty for s in settings], torch.float64)
        self.presence = as_t([s.presence_penalty for s in settings], torch.float64)
        self.frequency = as_t([s.frequency_penalty for s in settings], torch.float64)
        self.min_tokens = as_t([s.min_tokens for s in settings], torch.long)
        self.min_p = as_t([s.min_p for s in settings], torch.float64)
        self.eos = as_t(list(eos_ids), torch.long)
        # every (request, token, bias) of every logit_bias, flat: applied to a round's rows in one index_put
        biases = [(r, int(t), float(b)) for r, s in enumerate(settings) for t, b in s.logit_bias.items()]
        self.bias_request, self.bias_token = (as_t([x[i] for x in biases], torch.long) for i in (0, 1))
        self.bias_value = as_t([x[2] for x in biases], torch.float64)
        longest = max(len(p) for p in prompts)
        self.prompt = torch.zeros((n, longest), dtype=torch.long, device=device)
        for r, p in enumerate(prompts):
            self.prompt[r, :len(p)] = as_t(list(p), torch.long)
        self.prompt_len = as_t([len(p) for p in prompts], torch.long)
        self.history = torch.zeros((n, max(max_new) + 1), dtype=torch.long, device=device)
        self.generated = torch.zeros(n, dtype=torch.long, device=device)
        self.host_history: list[list[int]] = [[] for _ in range(n)]  # stop strings are judged on the host
        self.penalized = bool((self.repetition != 1).any() or (self.presence != 0).any()
                              or (self.frequency != 0).any())
        self.stops = any(s.stop for s in settings)
        self.changes_logits = any(s.changes_logits for s in settings)  # else greedy and sampling skip process()

    def _present(self, tokens, valid, vocab: int):
        """Counts [R, V] of each row's tokens [R, L] where valid [R, L]."""
        counts = torch.zeros((tokens.shape[0], vocab), dtype=torch.float64, device=self.device)
        return counts.scatter_add_(1, tokens, valid.double())

    def _counts(self, requests, drafted, width: int, vocab: int):
        """(counts [R, W, V] of the new tokens before query j, seen [R, W, V]: in the prompt or new),
        from the history and the drafts before query j (drafted [R, D]: d_0 .. d_{D-W+j})."""
        history, prompt = self.history[requests], self.prompt[requests]
        counts = self._present(history, _first(history.shape[1], self.generated[requests]), vocab)
        in_prompt = self._present(prompt, _first(prompt.shape[1], self.prompt_len[requests]), vocab) > 0
        counts = counts[:, None].repeat(1, width, 1)
        if drafted is not None and drafted.shape[1]:
            offset = drafted.shape[1] - (width - 1)
            before = _first(drafted.shape[1], torch.arange(width, device=self.device) + offset).double()  # [W, D]
            index = drafted[:, None, :].expand(-1, width, -1)
            counts.scatter_add_(2, index, before[None].expand(len(requests), -1, -1).contiguous())
        return counts, (counts > 0) | in_prompt[:, None]

    def process(self, logits, requests, drafted=None):
        """Steps 1-4 on the verify logits [R, W, V], query j after the row's drafts d_0 .. d_{j-1}
        (drafted [R, W-1]), or on a draft step's logits [R, V] after the drafts so far (drafted
        [R, s] or None); float64."""
        squeeze = logits.dim() == 2
        x = (logits[:, None] if squeeze else logits).to(torch.float64, copy=True)  # never the caller's logits
        rows, width, vocab = x.shape
        offset = 0 if drafted is None else drafted.shape[1] - (width - 1)  # drafts before query 0
        generated = self.generated[requests][:, None] + offset + torch.arange(width, device=self.device)[None, :]
        if len(self.bias_value):
            row, entry = (requests[:, None] == self.bias_request[None, :]).nonzero(as_tuple=True)  # [B] pairs
            query = torch.arange(width, device=self.device)[None, :].expand(len(row), -1)
            x.index_put_((row[:, None].expand_as(query), query, self.bias_token[entry][:, None].expand_as(query)),
                         self.bias_value[entry][:, None].expand_as(query), accumulate=True)
        if len(self.eos):
            held = generated < self.min_tokens[requests][:, None]  # [R, W]
            x[..., self.eos] = torch.where(held[..., None], float("-inf"), x[..., self.eos])
        if self.penalized:
            counts, seen = self._counts(requests, drafted, width, vocab)
            r = self.repetition[requests][:, None, None]
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
            x = x - self.frequency[requests][:, None, None] * counts \
                - self.presence[requests][:, None, None] * (counts > 0)
        return x[:, 0] if squeeze else x

    def finish_round(self, requests, choice, n, hit):
        """After a round's EOS and budget rule: cut each row with a stop string at the token that
        completes it (n smaller, hit = STOP), then append every row's committed tokens to its request's
        history. requests [R] and choice [R, W] on the device, n and hit [R] host; returns (n, hit)."""
        req = requests.tolist()
        if self.stops:
            host = choice.cpu().tolist()
            n, hit = n.copy(), hit.copy()
            for i, r in enumerate(req):
                stops = self.settings[r].stop
                if stops:
                    before = self.host_history[r]
                    cut = stop_cut(before + host[i][:n[i]], self.decode, stops, len(before))
                    if cut is not None:
                        n[i], hit[i] = cut - len(before), STOP
        width = choice.shape[1]
        count = torch.as_tensor(n, device=self.device)
        columns = (self.generated[requests][:, None] + torch.arange(width, device=self.device)[None, :])
        keep = torch.arange(width, device=self.device)[None, :] < count[:, None]
        rows = requests[:, None].expand(-1, width)
        self.history[rows[keep], columns[keep]] = choice[keep]
        self.generated[requests] += count
        if self.stops:
            for i, r in enumerate(req):
                self.host_history[r] += host[i][:n[i]]
        return n, hit


def _first(width: int, lengths):
    """[..., width] bool: index < length (lengths [...])."""
    return torch.arange(width, device=lengths.device) < lengths[..., None]
