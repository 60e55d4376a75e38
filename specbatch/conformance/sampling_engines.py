"""A textbook batch speculative sampler, correct or with one named bug: engines for the sampled checker.

`sampling_engine(target, draft=None, bug=None)` returns an engine of the sampled protocol

    sample_fn(prompts, max_new_tokens, eos_token_ids, batch_size, *, temperature, top_k, top_p, seeds,
              **processors) -> list[list[int]]      # one continuation per prompt, input order, the first EOS kept

Rows run together without a KV cache (each forward recomputes every row's sequence, right-padded),
so it suits tiny models. A round drafts `num_draft_tokens` tokens per row, verifies them in one
target forward (accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); after the first reject
sample from norm(max(0, p - q)); when every draft is accepted, the extra token comes from p_k),
and commits them up to the row's budget and first EOS. Without a draft it is target-only sampling.
Logit processors (reference.processors: repetition, presence and frequency penalties, logit bias,
min_tokens, min_p) process every query of the target and every draft step from that query's own
prefix, drafts included. Each row's randomness is keyed by its stream (fast.rng: stream, position,
purpose); correct rows use their own seed. `BUGS` names the mistakes it can make instead, each one line of change.
"""
from __future__ import annotations

import torch

from ..fast import rng
from ..fast.sampling import processed_log_probs, ranked_siblings, residual_distribution, sample_from

BUGS = {
    "draft-without-temperature": "the draft samples at temperature 1 while acceptance uses its tempered q "
                                 "(z-lab/dflash issue 74)",
    "draft-bf16-logits": "the draft samples after temperature and softmax in bfloat16 while acceptance uses "
                         "the float32 q (deepseek-ai/DeepSpec issue 31)",
    "draft-argmax": "the draft proposes its argmax while acceptance assumes it sampled "
                    "(jaymody/speculative-sampling issue 3)",
    "residual-unnormalised": "after a reject, inverse-CDF sampling from max(0, p - q) without dividing by its mass",
    "bonus-from-draft": "when every draft is accepted, the extra token comes from the draft's next distribution",
    "truncation-target-only": "top-k and top-p applied to the target only: acceptance uses the draft's "
                              "untruncated q while the draft sampled from its truncated one",
    "temperature-after-truncation": "top-k and top-p applied to the raw logits, the temperature after",
    "shared-stream": "one random stream for every row of a batch",
    "slot-keyed": "randomness keyed by batch slot, so that every batch repeats the same streams",
    "draft-noise-reused": "the acceptance test reuses the uniform that sampled the draft token "
                          "(vllm-project/vllm issue 47386)",
    "processors-bonus-only": "logit processors applied at each row's last verify query only, never at draft "
                             "positions (vllm-project/vllm issue 42744)",
    "penalties-drafts-ignored": "penalties at every verify query count the committed tokens only, not the drafts "
                                "before it",
    "min-tokens-off-by-one": "EOS held back until min_tokens - 1 new tokens (vllm-project/vllm PR 41768's class)",
}
PROCESSOR_BUGS = ("processors-bonus-only", "penalties-drafts-ignored", "min-tokens-off-by-one")
# Bugs of multi-candidate rejection over token trees (tree_branches > 1; proofs_notes/trees.md, Lemma T6)
TREE_BUGS = {
    "tree-ranked-leaves": "a token tree's leaves are the draft's next most likely tokens (as in greedy trees), tested "
                          "as if drawn from q",
    "tree-residual-stale": "after a rejected leaf the next candidate is tested against the residual from before it",
}


def _last_logits(model, tokens, lengths, last: int) -> torch.Tensor:
    """The logits at each row's last `last` tokens, lengths - last .. lengths - 1 (right-padded
    tokens [R, W] with lengths [R]; a row attends only to its own earlier tokens): [R, last, V], float64."""
    width = int(lengths.max())
    mask = torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]
    low = max(int(lengths.min()) - last, 0)  # logits only from the first position any row needs
    keep = torch.arange(low, width, device=tokens.device)
    with torch.inference_mode():
        logits = model(input_ids=tokens[:, :width], attention_mask=mask.long(), logits_to_keep=keep).logits
    at = (lengths[:, None] - last - low + torch.arange(last, device=tokens.device)[None, :]).clamp(min=0)
    return logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1])).double()


def _probs(logits, temperature, top_k, top_p, bug, min_p=0.0):
    """The processed distribution [.., V]; with temperature-after-truncation, in the wrong order."""
    if bug == "temperature-after-truncation":
        kept = processed_log_probs(logits, 1.0, top_k, top_p, min_p or None) > float("-inf")
        return (logits / temperature).masked_fill(~kept, float("-inf")).softmax(-1)
    return processed_log_probs(logits, temperature, top_k, top_p, min_p or None).exp()


def _process(logits, work, prompt_len, first, proc, eos, bug):
    """logits [R, L, V] predicting positions first .. first + L - 1 of each row of work [R, W], after
    the processors `proc` (reference.processors.Processors), each query from its own prefix
    work[r, :first + j] (prompt_len[r] of them the prompt): process_logits, vectorized."""
    if not proc.changes_logits:
        return logits
    rows, queries, vocab = logits.shape
    x = logits.clone()
    for token, bias in proc.logit_bias.items():
        x[..., int(token)] += bias
    end = first[:, None] + torch.arange(queries, device=x.device)[None, :]  # [R, L] each query's prefix length
    new = end - prompt_len[:, None]  # [R, L] new tokens before each query
    if proc.min_tokens and len(eos):
        limit = proc.min_tokens - 1 if bug == "min-tokens-off-by-one" else proc.min_tokens
        x[..., eos] = x[..., eos].masked_fill((new < limit)[..., None], float("-inf"))
    if bug == "penalties-drafts-ignored":
        end = first[:, None].expand(rows, queries)
    position = torch.arange(work.shape[1], device=x.device)[None, None, :]
    in_prefix = position < end[..., None]  # [R, L, W]
    generated = (in_prefix & (position >= prompt_len[:, None, None])).double()
    onehot = torch.nn.functional.one_hot(work, vocab).double()  # [R, W, V]
    counts = torch.einsum("rlw,rwv->rlv", generated, onehot)
    if proc.repetition_penalty != 1.0:
        seen = torch.einsum("rlw,rwv->rlv", in_prefix.double(), onehot) > 0
        r = proc.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - proc.frequency_penalty * counts - proc.presence_penalty * (counts > 0).to(x.dtype)


def _draft_step(logits, temperature, top_k, top_p, bug, u, min_p=0.0):
    """One draft step: (proposal [R], the q that acceptance uses [R, V])."""
    q = _probs(logits, temperature, top_k, top_p, bug, min_p)
    if bug == "draft-argmax":
        return q.argmax(-1), q
    source = q
    if bug == "draft-without-temperature":
        source = _probs(logits, 1.0, top_k, top_p, None, min_p)
    elif bug == "draft-bf16-logits":  # temperature and softmax in the logits' bfloat16
        scaled = (logits.to(torch.bfloat16) / temperature).double()
        source = _probs(scaled, 1.0, top_k, top_p, None).to(torch.bfloat16).double()
        source = source / source.sum(-1, keepdim=True)
    elif bug == "truncation-target-only":
        q = _probs(logits, temperature, None, None, None)
    return sample_from(source, u), q


def sampling_engine(target, draft=None, bug: str | None = None, num_draft_tokens: int = 4, planted=None,
                    tree_branches: int = 1):
    """The textbook sampler on (target, draft) as an engine; bug: None or a key of BUGS or TREE_BUGS;
    planted: (tv, positions) for target-only sampling with a planted deviation (see planted_engine);
    tree_branches > 1: each drafted position also has tree_branches - 1 leaves, further draws from
    the step's q, and the candidates are tested in turn against the residual (_tree_walk)."""
    if bug is not None and bug not in BUGS and bug not in TREE_BUGS:
        raise ValueError(f"unknown bug {bug!r}; known: {', '.join([*BUGS, *TREE_BUGS])}")
    if bug in TREE_BUGS and tree_branches < 2:
        raise ValueError(f"{bug} is a bug of token trees: it needs tree_branches >= 2")
    if planted is not None and draft is not None:
        raise ValueError("a planted deviation is for target-only sampling (draft=None)")
    k = num_draft_tokens if draft is not None else 0

    def sample_fn(prompts, max_new_tokens, eos_token_ids, batch_size, *, temperature, top_k=None, top_p=None,
                  seeds=None, **processors):
        from ..reference.processors import Processors
        proc = Processors(**processors)
        count = len(prompts)
        device = next(target.parameters()).device
        budget = torch.tensor(list(max_new_tokens), device=device)
        prompt_len, tokens = _prompt_buffer(prompts, budget, k, device)
        made = torch.zeros(count, dtype=torch.long, device=device)  # tokens committed per row
        done = budget <= 0
        eos = torch.tensor(list(eos_token_ids) or [-1], device=device)
        eos_ids = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
        stream_of = torch.tensor(_streams(seeds, count, batch_size, bug), device=device)
        while not done.all():
            rows = (~done).nonzero()[:, 0]
            stream, zero = stream_of[rows], torch.zeros_like(rows)
            length = prompt_len[rows] + made[rows]
            work = tokens[rows].clone()
            q = _draft_tokens(draft, work, length, prompt_len[rows], made[rows], stream, k, proc, eos_ids, bug,
                              temperature, top_k, top_p)  # writes the proposals into work
            drafted = work.gather(1, length[:, None] + torch.arange(k, device=device)[None, :])  # [R, k]
            p = _target_probs(target, work, length, prompt_len[rows], k, proc, eos_ids, bug, temperature, top_k,
                              top_p)  # [R, k + 1, V]
            index = torch.arange(len(rows), device=device)
            q = torch.stack(q, dim=1) if k else None  # [R, k, V]
            if k and tree_branches > 1:
                accepted, dist = _tree_walk(target, work, length, prompt_len[rows], p, q, drafted, made[rows], stream,
                                            tree_branches, proc, eos_ids, bug, temperature, top_k, top_p)
            else:
                accepted = _accepted(p, q, drafted, made[rows], stream, bug) if k else torch.zeros_like(rows)
                dist = p[index, accepted]
                if planted is not None:  # target-only: every live row is at the same position, made[rows]
                    dist = _plant(dist, planted, int(made[rows][0]), sample_fn.planted)
                if k:
                    dist = _chain_next(dist, q[index, accepted.clamp(max=k - 1)], accepted < k, draft, work, length,
                                       prompt_len[rows], k, proc, eos_ids, bug, temperature, top_k, top_p)
            token = sample_from(dist, rng.uniform(stream, zero, made[rows] + accepted, "sample"))
            work[index, length + accepted] = token
            committed, hit_eos = _committed(work, length, accepted, budget[rows] - made[rows], eos, k)
            tokens[rows] = work
            made[rows] += committed
            done[rows] = hit_eos | (made[rows] >= budget[rows])
        return [tokens[i, len(p):len(p) + int(made[i])].tolist() for i, p in enumerate(prompts)]
    sample_fn.planted = []  # with planted: the TV distance of every token drawn at a planted position
    return sample_fn


def _chain_next(p_at, q_at, rejected, draft, work, length, prompt_len, k: int, proc, eos_ids, bug, temperature,
                top_k, top_p):
    """The next token's distribution after a chain's accepted drafts: the residual norm(max(0, p - q))
    after a reject, else p (the bonus-from-draft bug: the draft's next distribution)."""
    residual = (p_at - q_at).clamp(min=0) if bug == "residual-unnormalised" else residual_distribution(p_at, q_at)
    bonus = p_at
    if bug == "bonus-from-draft":
        bonus = _probs(_process(_last_logits(draft, work, length + k, 1), work, prompt_len, length + k, proc, eos_ids,
                                bug)[:, 0], temperature, top_k, top_p, None, proc.min_p)
    return torch.where(rejected[:, None], residual, bonus)


def _tree_walk(target, work, length, prompt_len, p, q, drafted, made, stream, branches: int, proc, eos_ids, bug,
               temperature, top_k, top_p):
    """Multi-candidate rejection down a tree per row: under each spine token's parent, the spine
    token then branches - 1 leaves drawn from the same q, each with its own noise; candidate c is
    accepted with probability min(1, p'(c) / q(c)), p' the residual the rejected ones left (first the
    node's p). A leaf accepted is written into `work` in place of the spine token and ends the walk.
    Returns (tokens accepted per row [R], the distribution of the next token [R, V]: p after the
    whole spine, the residual where no candidate was accepted, p after an accepted leaf)."""
    rows, k = drafted.shape
    index, zero = torch.arange(rows, device=work.device), torch.zeros_like(stream)
    number = torch.arange(1, branches, device=work.device)[None, :]
    leaves = []
    for j in range(k):
        if bug == "tree-ranked-leaves":  # what a greedy tree takes: the next most likely tokens
            leaves.append(ranked_siblings(q[:, j], drafted[:, j], branches - 1))
        else:
            u = rng.uniform(stream[:, None], zero[:, None], (made + j)[:, None], "sibling", number)
            leaves.append(sample_from(q[:, j][:, None, :].expand(-1, branches - 1, -1), u))
    going = torch.ones(rows, dtype=torch.bool, device=work.device)
    accepted, at_leaf = torch.zeros_like(made), torch.zeros(rows, dtype=torch.bool, device=work.device)
    dist = p[:, k].clone()  # every spine token accepted: the next token from p after them
    for j in range(k):
        residual, chosen = p[:, j], torch.full_like(made, -1)
        for a in range(branches):
            token = drafted[:, j] if a == 0 else leaves[j][:, a - 1]
            u = (rng.uniform(stream, zero, made + j, "accept") if a == 0 else
                 rng.uniform(stream, zero, made + j, "accept-sibling", torch.full_like(made, a)))
            undecided = going & (chosen < 0)
            ok = undecided & (u * q[index, j, token] < residual[index, token])
            chosen = torch.where(ok, a, chosen)
            if not (bug == "tree-residual-stale" and a > 0):
                residual = torch.where((undecided & ~ok)[:, None], residual_distribution(residual, q[:, j]), residual)
        leaf = going & (chosen > 0)
        work[index[leaf], length[leaf] + j] = leaves[j][leaf, (chosen[leaf] - 1)]
        dist = torch.where((going & (chosen < 0))[:, None], residual, dist)
        accepted += going & (chosen >= 0)
        at_leaf |= leaf
        going = going & (chosen == 0)
    if at_leaf.any():  # the next token after an accepted leaf: the target's p after it
        after = _probs(_process(_last_logits(target, work, length + accepted, 1), work, prompt_len, length + accepted,
                                proc, eos_ids, bug)[:, 0], temperature, top_k, top_p, None, proc.min_p)
        dist = torch.where(at_leaf[:, None], after, dist)
    return accepted, dist


def _prompt_buffer(prompts, budget, k: int, device):
    """Each row's prompt length [N] and a token buffer [N, T] holding its prompt, room for its
    budget and one round's k + 1 more."""
    prompt_len = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.zeros(len(prompts), int((prompt_len + budget).max()) + k + 1, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    return prompt_len, tokens


def _plant(dist, planted, position: int, record: list):
    """dist with the planted deviation applied where position is planted; the TV distance of each
    moved row goes to record."""
    tv, positions = planted
    if positions is not None and position not in positions:
        return dist
    moved = move_to_runner_up(dist, tv)
    record.extend((moved - dist).abs().sum(-1).div(2).tolist())
    return moved


def _streams(seeds, count: int, batch_size: int, bug) -> list:
    """Each row's noise stream: its seed (default its index); the stream bugs key it by batch slot."""
    seeds = list(seeds) if seeds is not None else list(range(count))
    if bug == "shared-stream":  # every row of a batch reads its first row's stream
        return [seeds[i - i % batch_size] for i in range(count)]
    if bug == "slot-keyed":
        return [i % batch_size for i in range(count)]
    return seeds


def _target_probs(target, work, length, prompt_len, k: int, proc, eos_ids, bug, temperature, top_k, top_p):
    """The target's sampling distribution [R, k + 1, V] at every verify query, after the processors
    (min_p at the draft positions too, except under processors-bonus-only)."""
    raw = _last_logits(target, work, length + k, k + 1)  # [R, k + 1, V]
    processed = _process(raw, work, prompt_len, length, proc, eos_ids, bug)
    at_drafts = proc.min_p
    if bug == "processors-bonus-only":  # the draft positions' queries keep the raw logits
        processed, at_drafts = torch.cat([raw[:, :k], processed[:, k:]], dim=1), 0.0
    return torch.cat([_probs(processed[:, :k], temperature, top_k, top_p, bug, at_drafts),
                      _probs(processed[:, k:], temperature, top_k, top_p, bug, proc.min_p)], dim=1)


def _committed(work, length, accepted, left, eos, k: int):
    """(tokens each row commits [R], whether it hit EOS [R]): accepted + 1, up to the budget `left`
    and the first EOS (kept)."""
    steps = torch.arange(k + 1, device=work.device)[None, :]
    new = work.gather(1, length[:, None] + steps)  # [R, k + 1]
    offered = torch.minimum(accepted + 1, left)
    is_eos = (new[..., None] == eos).any(-1) & (steps < offered[:, None])
    return torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, offered), is_eos.any(1)


def _draft_tokens(draft, work, length, prompt_len, made, stream, k: int, proc, eos_ids, bug, temperature, top_k,
                  top_p) -> list:
    """k draft steps of every live row: each proposal sampled from the draft's processed distribution
    (noise keyed by the row's stream and position) and written into `work`; returns q per step [R, V]."""
    zero = torch.zeros_like(stream)
    q = []
    for j in range(k):
        logits = _process(_last_logits(draft, work, length + j, 1), work, prompt_len, length + j, proc, eos_ids,
                          bug)[:, 0]
        u = rng.uniform(stream, zero, made + j, "draft")
        proposal, q_j = _draft_step(logits, temperature, top_k, top_p, bug, u, proc.min_p)
        work[torch.arange(len(stream)), length + j] = proposal
        q.append(q_j)
    return q


def _accepted(p, q, drafted, made, stream, bug) -> torch.Tensor:
    """Accepted proposals per row [R]: proposal j stands while u_j q(d_j) < p(d_j), u_j the row's
    acceptance noise at its position (its draft noise under the draft-noise-reused bug)."""
    k = drafted.shape[1]
    p_d = p[:, :k].gather(-1, drafted[..., None])[..., 0]
    q_d = q.gather(-1, drafted[..., None])[..., 0]
    steps = made[:, None] + torch.arange(k, device=drafted.device)[None, :]
    u = rng.uniform(stream[:, None], torch.zeros_like(stream)[:, None], steps,
                    "draft" if bug == "draft-noise-reused" else "accept")
    return (u * q_d < p_d).long().cumprod(dim=1).sum(dim=1)


def move_to_runner_up(p: torch.Tensor, mass: float) -> torch.Tensor:
    """p [R, V] with min(mass, P(top)) moved from each row's most likely token to its runner-up
    (nothing moves where the runner-up has probability 0): a deviation whose total-variation
    distance from p is exactly the mass moved, and which stays inside p's support."""
    top2 = p.topk(2, dim=-1)
    moved = torch.minimum(torch.full_like(top2.values[:, 0], mass), top2.values[:, 0])
    moved = torch.where(top2.values[:, 1] > 0, moved, torch.zeros_like(moved))
    out = p.clone()
    rows = torch.arange(p.shape[0], device=p.device)
    out[rows, top2.indices[:, 0]] -= moved
    out[rows, top2.indices[:, 1]] += moved
    return out


def planted_engine(target, tv: float, positions=None):
    """Target-only sampling with a planted deviation of known size, for the sampled checker's
    sensitivity: at each new-token position in `positions` (None: every position) the token is drawn
    from move_to_runner_up(P, tv). `sample_fn.planted` collects the total-variation distance of
    every token drawn at a planted position (its mean is the deviation the checker faced)."""
    return sampling_engine(target, planted=(tv, positions))
