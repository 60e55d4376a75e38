"""How tokens are chosen: greedy, rejection sampling, or coupled (shared-Gumbel) sampling.

Every strategy calls a `Chooser` twice per round: `draft` for each draft step (the proposal, its
confidence, and for rejection sampling the draft's distribution q), and `verify` on the target's
logits, which returns (choice [R, W], accepted [R]) such that the row commits choice[:, :n] (n from
the EOS and budget rule); a row's `limit` is its own proposal length (fast.proposals). Randomness comes from fast.rng, keyed by (seed, request, absolute position, purpose).

- greedy: choice = argmax; accepted = agreeing prefix (I5).
- rejection (Leviathan et al., Chen et al.): accept draft d with probability min(1, p(d)/q(d)); on the
  first reject sample from norm(max(0, p - q)); when every considered draft is accepted, sample the
  next token from p. The committed tokens are distributed exactly as target-only sampling.
- coupled: one Gumbel vector g per (seed, request, position); target token argmax(log p + g), draft
  proposal argmax(log q + g), verification is equality: the committed stream equals target-only
  coupled sampling token for token, for any draft.
"""
from __future__ import annotations

import torch

from . import rng
from .drafts.reduced_head import SubsetLogits, full_logits
from .verify import greedy_accept


def processed_log_probs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                        min_p=None):
    """log-probabilities after temperature, top-k, top-p and min_p (float64; -inf outside the kept
    set). min_p: None, a number, or a tensor broadcastable to logits[..., :1] (one per row)."""
    x = logits.double()
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature  # top logit 0 first: finite at any normal temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    x = x.log_softmax(dim=-1)
    if min_p is not None:  # keep p >= min_p * max p: log p >= log min_p + max log p
        floor = torch.as_tensor(min_p, dtype=x.dtype, device=x.device).log() + x.amax(dim=-1, keepdim=True)
        x = x.masked_fill(x < floor, float("-inf")).log_softmax(dim=-1)
    return x


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) for every token (1 where q = 0: such a token is never proposed)."""
    return torch.where(q > 0, (p / q.clamp(min=1e-300)).clamp(max=1.0), torch.ones_like(p))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); equal to p where p = q (then a reject cannot happen anyway)."""
    r = (p - q).clamp(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-300), p)


def one_round_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Closed form of the first committed token's distribution given one draft from q: the draft is
    accepted with probability min(1, p/q), else the token comes from the residual. Built from the
    same functions the sampler uses; it must equal p (tested for many imposed (p, q))."""
    accepted = q * acceptance_probability(p, q)
    return accepted + (1 - accepted.sum(dim=-1, keepdim=True)) * residual_distribution(p, q)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of normalised probs [..., V] with uniforms u [...].

    It does not renormalise (an unnormalised residual would be a bug worth seeing); a u beyond the
    rounded total lands on the last token of non-zero probability."""
    cdf = probs.cumsum(dim=-1)
    index = torch.searchsorted(cdf, u.unsqueeze(-1).contiguous()).squeeze(-1)
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).long().argmax(dim=-1)
    return torch.minimum(index, last)


def next_distribution(p_at, q_at, rejected):
    """The distribution of the token after the accepted drafts: the residual after a reject, else p."""
    return torch.where(rejected[:, None], residual_distribution(p_at, q_at), p_at)


def mode_probability(log_probs: torch.Tensor) -> torch.Tensor:
    """The probability of the most likely token, from (unnormalised) log-probabilities [..., V]."""
    # softmax, not exp(max - logsumexp): logsumexp's exp is several times slower on the very negative
    # logits of a reduced head or a lookup (2.6 ms against 0.5 ms for [13, 49152] on this CPU)
    return torch.softmax(log_probs.float(), dim=-1).max(dim=-1).values


def ranked_siblings(logits, token: torch.Tensor, count: int) -> torch.Tensor:
    """[R, count]: each row's `count` most likely draft tokens other than its proposal `token` [R],
    most likely first (distinct, so the leaves under one node carry distinct tokens)."""
    if isinstance(logits, SubsetLogits):
        top = logits.token_ids[logits.values.topk(count + 1, dim=-1).indices]
    else:
        top = logits.topk(count + 1, dim=-1).indices  # [R, count + 1]
    other = (top == token[:, None]).to(torch.int8)  # 1 where the proposal itself: sorted last, stably
    return top.gather(1, torch.sort(other, dim=1, stable=True).indices[:, :count])


class Chooser:
    """draft(logits [R, V] or SubsetLogits, requests, positions, lookup=None, use_lookup=None) ->
    (proposals [R], q [R, V] or None, confidence [R]); with a lookup step (fast.drafts.lookup_draft.LookupStep),
    the rows in use_lookup [R] are drafted from the lookup's logits instead of the model's;
    confidence is the probability of the draft distribution's most likely token (the proposal rule
    of fast.proposals stops a row below a threshold; it depends on the row's distribution only, never
    on the token drawn, which keeps rejection sampling exact: proofs_notes/sampling.md).
    verify(logits [R, W, V], drafted [R, W-1], q, limit [R], requests, first_position) -> (choice [R, W],
    accepted [R]); verify_flat takes the logits of a flat forward [T, V] and layout [R, W], the flat
    index of each row's query j (repeating the row's last query past its proposals)."""

    needs_q = False
    processors = None  # fast.processors.LogitProcessors: penalties, bias, min_tokens (min_p when sampling)
    takes_lookup_leaves = True  # a lookup row's leaves may be any tokens: a leaf stays iff it is the target's choice

    def processed(self, logits, requests, drafted=None):
        """logits after the requests' processors (float64), or as they are without any."""
        if self.processors is None or not self.processors.changes_logits:
            return logits
        return self.processors.process(full_logits(logits), requests, drafted)

    @staticmethod
    def draft_logits(logits, lookup=None, use_lookup=None) -> torch.Tensor:
        """The step's logits over the whole vocabulary, the lookup's where use_lookup says."""
        logits = full_logits(logits)
        if lookup is None:
            return logits
        return torch.where(use_lookup[:, None], lookup.logits().to(logits.dtype), logits)

    def verify_flat(self, logits, layout, drafted, q, limit, requests, first_position):
        return self.verify(logits[layout], drafted, q, limit, requests, first_position)

    def siblings(self, logits, q, token, requests, positions, count: int) -> torch.Tensor:
        """[R, count]: a draft step's extra candidates beside its proposal `token` (a token tree's leaves,
        fast.trees): the draft's next most likely tokens (Rejection overrides: independent draws)."""
        return ranked_siblings(logits, token, count)

    def runner_ups(self, logits, requests, count: int, prefix=None) -> torch.Tensor:
        """[R, count] float: the 2nd..(count + 1)-th largest probabilities of a draft step's
        distribution (its processed one, as `confidence` is its largest): what the proposal rule
        prices a tree's leaves by (fast.proposals). A function of the row's distribution alone,
        never of a token drawn, so rejection sampling stays exact whatever the rule decides."""
        logits = self.processed(logits, requests, prefix)
        values = logits.values if isinstance(logits, SubsetLogits) else logits
        return torch.softmax(values.float(), dim=-1).topk(count + 1, dim=-1).values[:, 1:]

    def tree_choices(self, logits, gather, requests, predicted):
        """[R, W]: the token the target takes after each node of a tree verify (fast.trees), from the
        flat logits [N, V]; requests [N] and predicted [N] (the content index of the token each node
        predicts: c + depth) per node; gather [R, W] the flat index of row i's node j."""
        raise ValueError(f"{type(self).__name__} does not verify token trees")

    def draft_lookup(self, step, requests, positions):
        """draft() of a prompt lookup's step (fast.drafts.lookup_draft.LookupStep): its logits, one-hot where
        a row matched and uniform elsewhere, drafted like any other."""
        return self.draft(step.logits(), requests, positions)


class Greedy(Chooser):
    def __init__(self, processors=None):
        self.processors = processors

    def draft(self, logits, requests, positions, lookup=None, use_lookup=None, prefix=None):
        """A restricted head's SubsetLogits are read as they are: the argmax and the softmax over the
        subset equal those over the whole vocabulary (every other logit is so negative that its exp is
        0; the first maximum is the smallest token id either way, the subset being sorted)."""
        logits = self.processed(logits, requests, prefix)
        if isinstance(logits, SubsetLogits):
            token, confidence = logits.token_ids[logits.values.argmax(dim=-1)], mode_probability(logits.values)
        else:
            token, confidence = logits.argmax(dim=-1), mode_probability(logits)
        if lookup is not None:
            lookup_token, _, lookup_confidence = self.draft_lookup(lookup, requests, positions)
            token = torch.where(use_lookup, lookup_token, token)
            confidence = torch.where(use_lookup, lookup_confidence.to(confidence.dtype), confidence)
        return token, None, confidence

    def draft_lookup(self, step, requests, positions):
        """What draft(step.logits()) returns, without the [R, V] logits: a matched row's one-hot
        logits give its proposal with probability 1, an unmatched row's uniform ones token 0 (the
        first maximum) with probability 1 / V."""
        hit = step.matched > 0
        token = torch.where(hit, step.proposal, torch.zeros_like(step.proposal))
        uniform = torch.ones((), dtype=torch.float32, device=hit.device) / step.vocab
        return token, None, torch.where(hit, torch.ones_like(uniform), uniform)

    def verify(self, logits, drafted, q, limit, requests, first_position):
        choice = self.processed(logits, requests, drafted).argmax(dim=-1)
        return choice, greedy_accept(drafted, choice, limit)

    def tree_choices(self, logits, gather, requests, predicted):
        return logits.argmax(dim=-1)[gather]

    def verify_flat(self, logits, layout, drafted, q, limit, requests, first_position):
        if self.processors is not None and self.processors.changes_logits:
            return self.verify(logits[layout], drafted, q, limit, requests, first_position)
        choice = logits.argmax(dim=-1)[layout]  # argmax first: no [R, W, V] copy
        return choice, greedy_accept(drafted, choice, limit)


class Sampled(Chooser):
    """Common parts of the two sampling modes: processors and per-request seeds."""

    def __init__(self, temperature: float, top_k, top_p, seeds: torch.Tensor, ids: torch.Tensor | None = None,
                 processors=None):
        self.temperature, self.top_k, self.top_p, self.seeds = temperature, top_k, top_p, seeds
        self.ids = ids if ids is not None else torch.arange(len(seeds), device=seeds.device)
        self.processors = processors

    def keys(self, requests):
        """(seed, request id) used for keying: the caller's global ids (data-parallel shards)."""
        return self.seeds[requests], self.ids[requests]

    def runner_ups(self, logits, requests, count: int, prefix=None) -> torch.Tensor:
        probs = self.log_probs(full_logits(logits), requests, prefix).exp()
        return probs.topk(count + 1, dim=-1).values[:, 1:]

    def log_probs(self, logits, requests, drafted=None):
        """The requests' processed log-probabilities of logits [R, V] or [R, W, V] (query j after
        drafted[:, :j])."""
        logits = self.processed(logits, requests, drafted)
        min_p = None
        if self.processors is not None:
            min_p = self.processors.min_p[requests].view(-1, *[1] * (logits.dim() - 1))
        return processed_log_probs(logits, self.temperature, self.top_k, self.top_p, min_p)


class Coupled(Sampled):

    def draft(self, logits, requests, positions, lookup=None, use_lookup=None, prefix=None):
        log_q = self.log_probs(self.draft_logits(logits, lookup, use_lookup), requests, prefix)
        noise = rng.gumbel(*self.keys(requests), positions, log_q.shape[-1])
        return (log_q + noise).argmax(dim=-1), None, mode_probability(log_q)

    def verify(self, logits, drafted, q, limit, requests, first_position):
        width = logits.shape[1]
        positions = first_position[:, None] + torch.arange(width, device=logits.device)[None, :]
        expanded = requests[:, None].expand(-1, width)
        noise = rng.gumbel(*self.keys(expanded), positions, logits.shape[-1])
        choice = (self.log_probs(logits, requests, drafted) + noise).argmax(dim=-1)
        return choice, greedy_accept(drafted, choice, limit)

    def tree_choices(self, logits, gather, requests, predicted):
        """Each node's coupled choice: the Gumbel vector of (seed, request, the position it predicts),
        so a node standing for the sequence s takes what target-only coupled sampling appends to s."""
        noise = rng.gumbel(*self.keys(requests), predicted, logits.shape[-1])
        return (self.log_probs(logits, requests) + noise).argmax(dim=-1)[gather]


class Rejection(Sampled):
    needs_q = True
    takes_lookup_leaves = False  # every candidate must be a draw from q, and a lookup row's q is one-hot (T6)

    def siblings(self, logits, q, token, requests, positions, count: int) -> torch.Tensor:
        """count more independent draws from q [R, V], each keyed by its number (multi-candidate
        rejection needs every candidate drawn from q independently: proofs_notes/trees.md, Lemma T6);
        they may repeat the proposal or each other."""
        number = torch.arange(1, count + 1, device=q.device)[None, :]
        u = rng.uniform(*(key[:, None] for key in self.keys(requests)), positions[:, None], "sibling", number)
        return sample_from(q[:, None, :].expand(-1, count, -1), u)

    def draft(self, logits, requests, positions, lookup=None, use_lookup=None, prefix=None):
        q = self.log_probs(self.draft_logits(logits, lookup, use_lookup), requests, prefix).exp()
        u = rng.uniform(*self.keys(requests), positions, "draft")
        return sample_from(q, u), q, q.max(dim=-1).values

    def verify(self, logits, drafted, q, limit, requests, first_position):
        rows, width = logits.shape[0], logits.shape[1]
        k = width - 1
        p = self.log_probs(logits, requests, drafted).exp()  # [R, k+1, V]
        positions = first_position[:, None] + torch.arange(width, device=logits.device)[None, :]
        seeds, reqs = (x[:, None].expand(-1, width) for x in self.keys(requests))
        if k:
            p_d = p[:, :k].gather(-1, drafted[..., None])[..., 0]
            q_d = q.gather(-1, drafted[..., None])[..., 0]
            u = rng.uniform(seeds[:, :k], reqs[:, :k], positions[:, :k], "accept")
            ok = (u * q_d < p_d) & (torch.arange(k, device=logits.device)[None, :] < limit[:, None])
            accepted = ok.long().cumprod(dim=1).sum(dim=1)
        else:
            accepted = torch.zeros(rows, dtype=torch.long, device=logits.device)
        # the token after the accepted drafts: residual on a real reject, else from p
        at = accepted[:, None]
        p_at = p.gather(1, at[..., None].expand(-1, 1, p.shape[-1]))[:, 0]
        rejected = accepted < limit
        if k:
            q_at = q.gather(1, at.clamp(max=k - 1)[..., None].expand(-1, 1, q.shape[-1]))[:, 0]
            dist = next_distribution(p_at, q_at, rejected)
        else:
            dist = p_at
        u = rng.uniform(seeds[:, 0], reqs[:, 0], positions.gather(1, at)[:, 0], "sample")
        token = sample_from(dist, u)
        choice = torch.cat([drafted, drafted.new_zeros(rows, 1)], dim=1) if k else drafted.new_zeros(rows, 1)
        choice.scatter_(1, at, token[:, None])
        return choice, accepted


def make_chooser(temperature: float, top_k, top_p, seed, sampling: str, num_requests: int, device,
                 request_ids=None, processors=None):
    """seed: one for all requests, keyed with request_ids (default 0..n-1; a data-parallel shard
    passes the global ids of its requests so that outputs do not depend on the sharding), or one per
    request, which alone keys that request's randomness; processors: a fast.processors.LogitProcessors
    (None: none)."""
    if not temperature:
        return Greedy(processors)
    per_request = isinstance(seed, (list, tuple))
    seeds = seed if per_request else [seed] * num_requests
    seeds = torch.tensor([int(s) for s in seeds], dtype=torch.long, device=device)
    if per_request:  # a request's own seed alone keys its stream: the same tokens alone or in any batch and order
        ids = torch.zeros_like(seeds)
    else:  # one seed for all: keyed by (seed, request id)
        ids = None if request_ids is None else torch.tensor([int(r) for r in request_ids], device=device)
    cls = {"rejection": Rejection, "coupled": Coupled}[sampling]
    return cls(float(temperature), top_k, top_p, seeds, ids, processors)
