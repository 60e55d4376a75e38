"""Train the feature draft of fast/drafts/feature_draft.py (EAGLE-style) on the target's own features.

Input: the distillation examples of train_draft.py (prompt + the target's greedy answer) and the
target's features over them (training/target_features.py). The draft reads (t_j, f_{j-1}) and
predicts f_j; the loss at every answer position is
- smooth-L1 between f^_j and f_j (weight --feature-weight), and
- the cross-entropy of the target's own distribution there (its LM head on f_j, restricted to the
  tokens the answers use) under the draft's (the head on f^_j): top-1 agreement is what greedy
  verification accepts, the rest of the distribution is what the confidence threshold reads.
Both for the first draft step (true features everywhere) and the second: a second query per
position reads the first step's own f^_{j-1} (detached) and attends to the true K/V before it,
exactly as the second draft step of a round sees them (one forward through the cache, a mask that
lets query j of step 2 see keys 0..j-1 of step 1 and itself).
The target's embedding and LM head are frozen; fc starts random, the layer and the final norm as
copies of the target's last decoder layer and final norm.

    python training/train_feature_draft.py --prompts training/data/stage1.jsonl training/data/stage2.jsonl \
        --answers training/data/stage1_answers.jsonl training/data/stage2_answers.jsonl \
        --features training/data/features.pt --out fast/distilled/smollm2-feature-draft --max-minutes 30

Writes fast.drafts.feature_draft.FeatureDraftNet.save's files to --out (weights in float16, config,
output tokens, training_log.json with the validation agreement of steps 1 and 2).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from target_features import feature_arguments, feature_examples, feature_rms, log_step
from train_draft import Schedule, make_batches


def collate(batch, features: dict, hidden: int):
    """Right-padded ids [B, W], features [B, W, H], and the (row, index) of every answer position
    j (index first_answer - 1 .. len - 2: f_j predicts the answer token j + 1)."""
    width = max(len(ids) for _, ids, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    feats = torch.zeros(len(batch), width, hidden)
    rows, index = [], []
    for r, (ident, tokens, first) in enumerate(batch):
        ids[r, :len(tokens)] = torch.tensor(tokens)
        feats[r, :len(tokens)] = features[ident].float()
        rows += [r] * (len(tokens) - first)
        index += range(first - 1, len(tokens) - 1)
    return ids, feats, torch.tensor(rows), torch.tensor(index)


def shifted(feats: torch.Tensor) -> torch.Tensor:
    """The draft's feature inputs [B, W, H] from the features [B, W, H]: f_{j-1} at index j, zero at 0."""
    return torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)


def second_step_mask(width: int) -> torch.Tensor:
    """[W, 2W] boolean: step-2 query j sees step-1 keys 0..j-1 and its own step-2 key."""
    j = torch.arange(width)[:, None]
    key = torch.arange(2 * width)[None, :]
    return (key < j) | (key == width + j)


def forward_two_steps(net, embedded, true_in):
    """(f^ of step 1, f^ of step 2), each [B, W, H]."""
    batch, width, _ = embedded.shape
    position = torch.arange(width)[None].expand(batch, width)
    cos_sin = net.rotary(embedded, position)
    cache = DynamicCache()
    x1 = net.fc(torch.cat([embedded, true_in], dim=-1))
    causal = torch.ones(width, width, dtype=torch.bool).tril()[None, None]
    step1 = net.norm(net.layer(x1, attention_mask=causal, position_ids=position, position_embeddings=cos_sin,
                               cache=cache, use_cache=True))
    own = torch.cat([torch.zeros_like(step1[:, :1]), step1[:, :-1].detach()], dim=1)  # f^_{j-1} from step 1
    x2 = net.fc(torch.cat([embedded, own], dim=-1))
    step2 = net.norm(net.layer(x2, attention_mask=second_step_mask(width)[None, None], position_ids=position,
                               position_embeddings=cos_sin, cache=cache, use_cache=True))
    return step1, step2


def losses(predicted, feats, rows, index, head, feature_weight: float):
    """(loss, agreement count) at the answer positions."""
    got, want = predicted[rows, index], feats[rows, index]
    logits = got @ head.T
    with torch.no_grad():
        teacher = (want @ head.T).softmax(dim=-1)
    soft = -(teacher * logits.log_softmax(dim=-1)).sum(dim=-1).mean()
    agree = (logits.argmax(-1) == teacher.argmax(-1)).sum().item()
    return soft + feature_weight * F.smooth_l1_loss(got, want), agree


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    feature_arguments(parser)
    parser.add_argument("--intermediate", type=int, default=None, help="the layer's MLP width (default: the target's)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--feature-weight", type=float, default=1.0)
    parser.add_argument("--noise", type=float, default=0.1, help="uniform noise on the input features, times their RMS")
    args = parser.parse_args(argv)

    from specbatch.fast.drafts.feature_draft import FeatureDraftNet, feature_draft_config
    from specbatch.fast.loading import load_model

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target, tokenizer = load_model(args.target)
    features, train, valid = feature_examples(args, tokenizer)
    used = sorted({t for _, ids, first in train for t in ids[first:]})
    head = target.get_output_embeddings().weight.detach()[torch.tensor(used)].float()
    embedding = target.get_input_embeddings()
    config = feature_draft_config(target.config, args.intermediate)
    net = FeatureDraftNet(config)
    if args.intermediate is None:  # start from the target's last layer
        net.layer.load_state_dict(target.model.layers[-1].state_dict())
    net.norm.load_state_dict(target.model.norm.state_dict())
    for p in list(embedding.parameters()):
        p.requires_grad_(False)
    hidden = config.hidden_size
    scale = feature_rms(features, train)
    print(f"{len(train)} training / {len(valid)} validation examples, {len(used)} output tokens, "
          f"feature RMS {scale:.3f}, {sum(p.numel() for p in net.parameters())} parameters", flush=True)

    valid_batches = make_batches(valid, 4096, random.Random(0))
    steps_per_epoch = len(make_batches(train, args.tokens_per_batch, random.Random(0)))
    total_steps = max(1, int(steps_per_epoch * args.epochs))
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))

    @torch.no_grad()
    def validate():
        net.eval()
        agree, total = [0, 0], 0
        for batch in valid_batches:
            ids, feats, rows, index = collate(batch, features, hidden)
            for s, out in enumerate(forward_two_steps(net, embedding(ids), shifted(feats))):
                agree[s] += losses(out, feats, rows, index, head, args.feature_weight)[1]
            total += len(rows)
        net.train()
        return [round(a / max(total, 1), 4) for a in agree]

    schedule = Schedule(total_steps, min(50, total_steps // 10), args.max_minutes, floor=0.02)
    step, log, best = 0, [], (-1.0, None, None)
    while not schedule.done(step):
        for batch in make_batches(train, args.tokens_per_batch, rng):
            ids, feats, rows, index = collate(batch, features, hidden)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * schedule.factor(step)
            true_in = shifted(feats)
            noisy = true_in + (torch.rand_like(true_in) * 2 - 1) * args.noise * scale
            with torch.no_grad():
                embedded = embedding(ids)
            step1, step2 = forward_two_steps(net, embedded, noisy)
            loss1, agree1 = losses(step1, feats, rows, index, head, args.feature_weight)
            loss2, agree2 = losses(step2, feats, rows, index, head, args.feature_weight)
            loss = loss1 + 0.5 * loss2
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            optimizer.step()
            step += 1
            done = schedule.done(step)
            if step % 25 == 0 or done:
                entry = dict(step=step, loss=round(loss.item(), 4), train_step1=round(agree1 / len(rows), 3),
                             train_step2=round(agree2 / len(rows), 3), minutes=round(schedule.elapsed() / 60, 2))
                best = log_step(entry, log, net, best, validate, step % 200 == 0 or done)
            if done:
                break
    if best[2] is not None and best[1] != step:
        net.load_state_dict(best[2])
    final = validate()
    summary = dict(seed=args.seed, training_examples=len(train), validation_examples=len(valid), steps=step,
                   epochs=round(step / steps_per_epoch, 2), lr=args.lr, feature_weight=args.feature_weight,
                   noise=args.noise, intermediate=config.intermediate_size, output_tokens_trained=len(used),
                   parameters=sum(p.numel() for p in net.parameters()), kept_step=best[1] or step,
                   wall_minutes=round(schedule.elapsed() / 60, 1), validation_step1=final[0],
                   validation_step2=final[1], torch_threads=torch.get_num_threads(), log=log)
    net.save(Path(args.out), used, summary)
    print(f"validation agreement step 1 {final[0]:.3f}, step 2 {final[1]:.3f}; saved to {args.out}")


if __name__ == "__main__":
    main()
