"""Train the feature head of fast/drafts/feature_draft.py (FeatureHeadNet) on the target's own features.

The head reads (t_j, f_{j-1}) at one position, no attention: f^_j = norm(f_{j-1} + down(silu(fc([embed(t_j),
f_{j-1}])))), and the target's LM head on f^_j (restricted to the tokens the answers use) proposes
t_{j+1}. Since every position stands alone, training runs on single positions drawn at random from
every answer of the distillation data (training/target_features.py's features over train_draft.py's
examples): step 1 reads the true f_{j-1}; step 2 reads step 1's own f^_j (detached) with the next
token t_{j+1} and proposes t_{j+2}, exactly what a round's second draft step reads. The loss is the
cross-entropy of the target's greedy token (the answers are the target's greedy outputs), step 1 plus
--second-weight times step 2. The target's embedding and LM head are frozen.

    python training/train_feature_head.py --prompts training/data/stage1.jsonl training/data/stage2.jsonl \\
        --answers training/data/stage1_answers.jsonl training/data/stage2_answers.jsonl \\
        --features training/data/features.pt --out fast/distilled/smollm2-feature-head --max-minutes 12

Writes FeatureHeadNet.save's files to --out (weights in float16, config, output tokens,
training_log.json with the validation agreement of steps 1 and 2); `--draft feature:DIR` loads it.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from target_features import feature_arguments, feature_examples, log_step


def positions(examples, features):
    """Every answer position j with a next token: (f_{j-1} [N, H], t_j, t_{j+1}, t_{j+2} or -1)."""
    feats, tokens, nexts, afters = [], [], [], []
    for ident, ids, first in examples:
        ids = torch.tensor(ids)
        j = torch.arange(max(first - 1, 1), len(ids) - 1)
        if not len(j):
            continue
        feats.append(features[ident][j - 1])
        tokens.append(ids[j])
        nexts.append(ids[j + 1])
        afters.append(torch.cat([ids[j[:-1] + 2], torch.tensor([-1])]))
    return torch.cat(feats), torch.cat(tokens), torch.cat(nexts), torch.cat(afters)


def two_steps(net, embedding, head, feats, token, nxt):
    """Logits of step 1 (from f_{j-1}, t_j) and step 2 (from step 1's f^_j, t_{j+1})."""
    first = net(embedding(token), feats)
    second = net(embedding(nxt), first.detach())
    return first @ head.T, second @ head.T


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    feature_arguments(parser)
    parser.add_argument("--intermediate", type=int, default=1536, help="the MLP's inner width")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=2048, help="positions per step")
    parser.add_argument("--second-weight", type=float, default=0.5, help="weight of step 2's loss")
    args = parser.parse_args(argv)

    from specbatch.fast.drafts.feature_draft import FeatureHeadNet, feature_head_config
    from specbatch.fast.loading import load_model

    torch.manual_seed(args.seed)
    target, tokenizer = load_model(args.target)
    features, train, valid = feature_examples(args, tokenizer)
    used = sorted({t for _, ids, first in train for t in ids[first:]})
    index_of = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    index_of[torch.tensor(used)] = torch.arange(len(used))
    head = target.get_output_embeddings().weight.detach()[torch.tensor(used)].float()
    embedding = target.get_input_embeddings().requires_grad_(False)
    net = FeatureHeadNet(feature_head_config(target.config, args.intermediate))
    feats, token, nxt, after = positions(train, features)
    label1, label2 = index_of[nxt], torch.where(after >= 0, index_of[after.clamp(min=0)], -1)
    valid_data = positions(valid, features)
    print(f"{len(train)} training / {len(valid)} validation examples, {len(token)} positions, {len(used)} output "
          f"tokens, {sum(p.numel() for p in net.parameters())} parameters", flush=True)

    @torch.no_grad()
    def validate():
        f, t, n, a = valid_data
        agree, total = [0, 0], [0, 0]
        for start in range(0, len(t), 8192):
            part = slice(start, start + 8192)
            logits = two_steps(net, embedding, head, f[part].float(), t[part], n[part])
            for s, (out, want) in enumerate(zip(logits, (n[part], a[part]))):
                keep = want >= 0
                agree[s] += (torch.tensor(used)[out.argmax(-1)] == want)[keep].sum().item()
                total[s] += keep.sum().item()
        return [round(a / max(t, 1), 4) for a, t in zip(agree, total)]

    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    epochs_steps = max(1, int(args.epochs * len(token) / args.batch))
    start, step, log, best = time.time(), 0, [], (-1.0, None, None)
    budget = (args.max_minutes or math.inf) * 60

    def factor():  # warm-up over 20 steps, then a cosine over whichever ends first: the steps or the minutes
        progress = max(step / epochs_steps, (time.time() - start) / budget)
        return min(1.0, (step + 1) / 20) * max(0.02, 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    generator = torch.Generator().manual_seed(args.seed)
    while step < epochs_steps and time.time() - start < budget:
        pick = torch.randint(0, len(token), (args.batch,), generator=generator)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * factor()
        logits1, logits2 = two_steps(net, embedding, head, feats[pick].float(), token[pick], nxt[pick])
        loss1 = F.cross_entropy(logits1, label1[pick], ignore_index=-1)
        loss2 = F.cross_entropy(logits2, label2[pick], ignore_index=-1)
        loss = loss1 + args.second_weight * loss2
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        done = step >= epochs_steps or time.time() - start >= budget
        if step % 50 == 0 or done:
            entry = dict(step=step, loss1=round(loss1.item(), 4), loss2=round(loss2.item(), 4),
                         minutes=round((time.time() - start) / 60, 2))
            best = log_step(entry, log, net, best, validate, step % 200 == 0 or done)
    if best[2] is not None and best[1] != step:
        net.load_state_dict(best[2])
    final = validate()
    summary = dict(seed=args.seed, training_examples=len(train), validation_examples=len(valid), positions=len(token),
                   steps=step, epochs=round(step * args.batch / len(token), 2), lr=args.lr, batch=args.batch,
                   second_weight=args.second_weight, intermediate=args.intermediate, output_tokens_trained=len(used),
                   parameters=sum(p.numel() for p in net.parameters()), kept_step=best[1] or step,
                   wall_minutes=round((time.time() - start) / 60, 1), validation_step1=final[0],
                   validation_step2=final[1], torch_threads=torch.get_num_threads(), log=log)
    net.save(Path(args.out), used, summary)
    print(f"validation agreement step 1 {final[0]:.3f}, step 2 {final[1]:.3f}; saved to {args.out}")


if __name__ == "__main__":
    main()
