"""Distil a small LlamaForCausalLM draft from the target's own greedy answers.

Input: prompt files (JSONL with `id`, `prompt`) and the target's answers to them, as written by
`specbatch generate --draft none --chat-template` (JSONL with `id`, `token_ids`). Each example is
the chat-templated prompt followed by the answer; the loss is the cross-entropy of the target's
greedy token at every answer position (the draft learns to agree with the target's argmax, which is
what greedy verification accepts). With `--teacher` (a file of training/teacher_probs.py: the
target's top-k probabilities at every answer position) the loss mixes in the cross-entropy against
the target's distribution, weight `--soft-weight`: soft labels say how sure the target is, which a
draft needs to know when to stop proposing (fast/proposals.py), and they over-fit less than one
label per position. The draft's tied embedding starts as the projection of the
target's embedding on its first principal components; everything else is random.

    python training/train_draft.py --prompts training/data/stage1.jsonl training/data/stage2.jsonl \
        --answers training/data/stage1_answers.jsonl training/data/stage2_answers.jsonl \
        --out fast/distilled/smollm2-draft --epochs 2

Writes config.json, generation_config.json, model.safetensors, training_log.json (seed, data
size, steps, wall time, validation agreement) and output_tokens.json (the tokens trained as outputs,
the draft's reduced head) to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
import zlib
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def read_jsonl(paths) -> dict:
    records = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    records[str(record["id"])] = record
    return records


def load_examples(prompt_files, answer_files, tokenizer, max_len: int) -> list[tuple[str, list[int], int]]:
    """(id, prompt + answer token ids, index of the first answer token), answered prompts only."""
    from specbatch.prepare import encode_prompts  # the chat template exactly as `specbatch generate` applied it

    prompts, answers = read_jsonl(prompt_files), read_jsonl(answer_files)
    answered = [ident for ident, answer in answers.items() if ident in prompts and answer["token_ids"]]
    encoded = encode_prompts([prompts[ident]["prompt"] for ident in answered], tokenizer, chat_template=True)
    examples = []
    for ident, prompt_ids in zip(answered, encoded):
        ids = (prompt_ids + list(answers[ident]["token_ids"]))[:max_len]
        if len(prompt_ids) < len(ids):
            examples.append((ident, ids, len(prompt_ids)))
    return examples


def draft_config(target_config, hidden: int, layers: int, intermediate: int, heads: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=getattr(target_config, "rope_parameters", None), rms_norm_eps=target_config.rms_norm_eps,
        tie_word_embeddings=True, bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id, pad_token_id=target_config.pad_token_id,
    )


def new_draft(target, hidden: int, layers: int, intermediate: int, heads: int) -> LlamaForCausalLM:
    """A float32 draft of draft_config whose tied embedding is the PCA projection of the target's
    (pca_embedding); everything else random."""
    draft = LlamaForCausalLM(draft_config(target.config, hidden, layers, intermediate, heads)).float()
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(pca_embedding(target.get_input_embeddings().weight.float(), hidden))
    return draft


def pca_embedding(embedding: torch.Tensor, hidden: int) -> torch.Tensor:
    """The target's embedding projected on its `hidden` first principal directions, scaled to rows
    of about unit norm (initial logits of order 1 through the tied head)."""
    centered = embedding - embedding.mean(dim=0)
    _, _, v = torch.linalg.svd(centered, full_matrices=False)
    projected = centered @ v[:hidden].T
    return projected / projected.std() / math.sqrt(hidden)


class Schedule:
    """The learning-rate factor of a run: a linear warm-up over `warmup` steps, then a cosine from 1
    down to `floor`. The run's progress is by steps, or by wall time (from construction) when a
    `max_minutes` budget ends it sooner; `done(step)` says when it is over."""

    def __init__(self, total_steps: int, warmup: int, max_minutes: float | None = None, floor: float = 0.05):
        self.total_steps, self.warmup, self.floor = total_steps, warmup, floor
        self.budget = max_minutes * 60 if max_minutes else None
        self.start = time.time()

    def elapsed(self) -> float:
        return time.time() - self.start

    def progress(self, step: int) -> float:
        return max(step / self.total_steps, self.elapsed() / self.budget if self.budget else 0.0)

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, self.progress(step))))


def is_validation(ident: str, share: float) -> bool:
    return zlib.crc32(ident.encode()) % 1000 < share * 1000


def make_batches(examples, tokens_per_batch: int, rng: random.Random) -> list[list]:
    """Length-sorted batches of about `tokens_per_batch` padded tokens, in random order."""
    order = sorted(examples, key=lambda e: len(e[1]))
    batches, current = [], []
    for example in order:
        if current and (len(current) + 1) * len(example[1]) > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(example)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(batch, pad_id: int):
    """Right-padded ids, their attention mask, and (row, position, label) of every answer token."""
    width = max(len(ids) for _, ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    rows, positions = [], []
    for r, (_, tokens, first_answer) in enumerate(batch):
        ids[r, : len(tokens)] = torch.tensor(tokens)
        attention[r, : len(tokens)] = 1
        for p in range(first_answer - 1, len(tokens) - 1):  # position p predicts token p + 1
            rows.append(r)
            positions.append(p)
    rows, positions = torch.tensor(rows), torch.tensor(positions)
    return ids, attention, rows, positions, ids[rows, positions + 1]


def soft_labels(batch, teacher: dict, remap):
    """The teacher's top-k (candidate index [N, K], probability [N, K]) at the answer positions of
    `batch`, in collate's order; entries outside the candidate tokens are dropped and the rest
    renormalised (remap None: the whole vocabulary)."""
    indices = torch.cat([teacher[ident][0] for ident, _, _ in batch]).long()
    probs = torch.cat([teacher[ident][1] for ident, _, _ in batch]).float()
    if remap is not None:
        indices = remap[indices]
        probs = torch.where(indices >= 0, probs, torch.zeros_like(probs))
    return indices.clamp(min=0), probs / probs.sum(dim=-1, keepdim=True).clamp(min=1e-9)


def answer_logits(draft, ids, attention, rows, positions, candidates=None):
    """The draft's logits at the answer positions, over the whole vocabulary or only `candidates`."""
    hidden = draft.model(input_ids=ids, attention_mask=attention).last_hidden_state[rows, positions]
    if candidates is None:
        return draft.lm_head(hidden)
    return hidden @ draft.lm_head.weight[candidates].T


@torch.no_grad()
def agreement(draft, batches, pad_id: int) -> float:
    """Share of answer positions where the draft's argmax is the target's greedy token."""
    draft.eval()
    hits = total = 0
    for batch in batches:
        ids, attention, rows, positions, labels = collate(batch, pad_id)
        hits += (answer_logits(draft, ids, attention, rows, positions).argmax(-1) == labels).sum().item()
        total += labels.numel()
    draft.train()
    return hits / max(total, 1)


def data_arguments(parser) -> None:
    """The target, the distillation data and how it is cut and batched (shared with teacher_probs.py)."""
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--prompts", nargs="+", required=True)
    parser.add_argument("--answers", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data_arguments(parser)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="time budget: the learning rate anneals over it and the run ends with it (or after "
                             "--epochs, whichever comes first)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--validation-share", type=float, default=0.04)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teacher", default=None,
                        help="training/teacher_probs.py output: also learn the target's distribution (soft labels)")
    parser.add_argument("--soft-weight", type=float, default=0.7,
                        help="with --teacher: loss = w * soft cross-entropy + (1 - w) * hard cross-entropy")
    parser.add_argument("--full-softmax", action="store_true",
                        help="normalise over the whole vocabulary (default: over the tokens the target's answers use, "
                             "several times cheaper; agreement is still measured with the whole vocabulary)")
    args = parser.parse_args(argv)

    from specbatch.fast.loading import load_model  # the same loader as the CLI (fetches SmolLM2 once)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target, tokenizer = load_model(args.target)
    examples = load_examples(args.prompts, args.answers, tokenizer, args.max_len)
    train = [e for e in examples if not is_validation(e[0], args.validation_share)]
    valid = [e for e in examples if is_validation(e[0], args.validation_share)]
    answer_tokens = sum(len(ids) - first for _, ids, first in train)
    print(f"{len(train)} training examples ({answer_tokens} answer tokens), {len(valid)} validation", flush=True)

    draft = new_draft(target, args.hidden, args.layers, args.intermediate, args.heads)
    config = draft.config
    draft.generation_config.eos_token_id = target.generation_config.eos_token_id
    del target
    teacher = torch.load(args.teacher) if args.teacher else None
    if teacher is not None:
        missing = [ident for ident, _, _ in train if ident not in teacher]
        if missing:
            parser.error(f"--teacher {args.teacher} has no distribution for {len(missing)} training examples "
                         f"(e.g. {missing[0]!r}); recompute it with training/teacher_probs.py")
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0

    candidates = remap = None
    if not args.full_softmax:  # the output tokens the target actually uses in its answers
        used = sorted({t for _, ids, first in train for t in ids[first:]})
        candidates = torch.tensor(used)
        remap = torch.full((config.vocab_size,), -1, dtype=torch.long)
        remap[candidates] = torch.arange(len(used))
        print(f"softmax over the {len(used)} tokens the answers use", flush=True)
    valid_batches = make_batches(valid, args.tokens_per_batch, rng)
    steps_per_epoch = len(make_batches(train, args.tokens_per_batch, random.Random(0)))
    total_steps = max(1, int(steps_per_epoch * args.epochs))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = Schedule(total_steps, min(100, total_steps // 10), args.max_minutes)
    step, seen_tokens, log = 0, 0, []
    best = (-1.0, 0, None)  # (validation agreement, step, weights)
    print(f"{sum(p.numel() for p in draft.parameters())} parameters, at most {total_steps} steps", flush=True)
    while not schedule.done(step):
        for batch in make_batches(train, args.tokens_per_batch, rng):
            ids, attention, rows, positions, labels = collate(batch, pad_id)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * schedule.factor(step)
            logits = answer_logits(draft, ids, attention, rows, positions, candidates)
            loss = torch.nn.functional.cross_entropy(logits, labels if remap is None else remap[labels])
            if teacher is not None:
                indices, probs = soft_labels(batch, teacher, remap)
                soft = -(probs * logits.log_softmax(dim=-1).gather(1, indices)).sum(dim=-1).mean()
                loss = args.soft_weight * soft + (1 - args.soft_weight) * loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            optimizer.step()
            step += 1
            seen_tokens += labels.numel()
            done = schedule.done(step)
            if step % 50 == 0 or done:
                elapsed = schedule.elapsed()
                entry = dict(step=step, loss=round(loss.item(), 4), minutes=round(elapsed / 60, 2),
                             tokens_per_s=round(seen_tokens / elapsed), lr=round(args.lr * schedule.factor(step), 6))
                if step % 500 == 0 or done:
                    entry["validation_agreement"] = round(agreement(draft, valid_batches, pad_id), 4)
                    if entry["validation_agreement"] > best[0]:  # keep the best weights (over-fitting guard)
                        best = (entry["validation_agreement"], step,
                                {k: v.detach().clone() for k, v in draft.state_dict().items()})
                log.append(entry)
                print(entry, flush=True)
            if done:
                break

    if best[2] is not None and best[1] != step:
        print(f"restoring the weights of step {best[1]} (validation agreement {best[0]:.4f})", flush=True)
        draft.load_state_dict(best[2])
    final = agreement(draft, valid_batches, pad_id)
    out = Path(args.out)
    draft.to(torch.float16).save_pretrained(out)  # float16 on disk: 2 bytes a parameter
    summary = dict(
        seed=args.seed, prompts=args.prompts, answers=args.answers, training_examples=len(train),
        training_answer_tokens=answer_tokens, validation_examples=len(valid), steps=step,
        epochs=round(step / steps_per_epoch, 2), tokens_per_batch=args.tokens_per_batch, lr=args.lr,
        output_tokens_trained=None if candidates is None else len(candidates), hidden=args.hidden,
        layers=args.layers, intermediate=args.intermediate, heads=args.heads,
        parameters=sum(p.numel() for p in draft.parameters()), wall_minutes=round(schedule.elapsed() / 60, 1),
        kept_step=best[1] if best[2] is not None else step,
        teacher=args.teacher, soft_weight=args.soft_weight if args.teacher else None,
        validation_agreement=round(final, 4), torch_threads=torch.get_num_threads(), log=log,
    )
    (out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    if candidates is not None:  # the reduced head of fast/drafts/reduced_head.py: the tokens trained as outputs
        (out / "output_tokens.json").write_text(json.dumps(candidates.tolist()) + "\n")
    print(f"validation agreement {final:.3f}; saved to {out}")


if __name__ == "__main__":
    main()
