"""Train a token draft that also reads the target's features (fast/drafts/feature_draft.py).

The draft's input embedding at content index j is embed(t_j) + P f_{j-1}, where f_{j-1} is the
target's final hidden state one index earlier (training/target_features.py) and P a projection to
the draft's width that starts at zero. Drafting past the content has no target feature (the target
has not seen the proposals yet): there the draft reads zero, and training zeroes the feature at a
random share of positions (--feature-dropout) so it keeps predicting from tokens alone where it must.
The draft is either new (as train_draft.py makes it: PCA embedding, the rest random) or, with
--init, an existing token draft fine-tuned (then use a small --lr and --projection-lr).

    python training/train_conditioned_draft.py --prompts training/data/stage1.jsonl training/data/stage2.jsonl \
        --answers training/data/stage1_answers.jsonl training/data/stage2_answers.jsonl \
        --features training/data/features.pt --out conditioned-draft --epochs 40 --max-minutes 26
    # or from the shipped draft:  --init fast/distilled/smollm2-draft --lr 5e-4 --projection-lr 2e-5

Loss: the cross-entropy of the target's greedy token at every answer position, softmax over the
tokens the answers use (as train_draft.py). Writes the draft (config, float16 safetensors,
output_tokens.json), feature_projection.pt (P, reading the raw features) and training_log.json
(validation agreement with the feature and without it, at the start and along the way).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from target_features import feature_arguments, feature_examples, feature_rms
from train_draft import Schedule, collate, make_batches, new_draft


def feature_inputs(batch, features: dict, width: int, hidden: int, scale: float) -> torch.Tensor:
    """[B, W, H]: f_{j-1} * scale at index j (zero at j = 0 and past each example)."""
    out = torch.zeros(len(batch), width, hidden)
    for r, (ident, tokens, _) in enumerate(batch):
        out[r, 1:len(tokens)] = features[ident][:len(tokens) - 1].float() * scale
    return out


def logits_at(draft, projection, ids, attention, feats, rows, positions, candidates):
    embeds = draft.model.embed_tokens(ids) + projection(feats)
    hidden = draft.model(inputs_embeds=embeds, attention_mask=attention).last_hidden_state[rows, positions]
    return hidden @ draft.lm_head.weight[candidates].T


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    feature_arguments(parser)
    parser.add_argument("--init", default=None, help="a token draft to start from (a train_draft.py output; default: "
                        "a new one, as train_draft.py makes it)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the draft's own weights")
    parser.add_argument("--projection-lr", type=float, default=1e-4,
                        help="peak learning rate of the projection (it reads the features divided by their RMS; "
                             "larger steps swamp the embedding at once)")
    parser.add_argument("--feature-dropout", type=float, default=0.3)
    args = parser.parse_args(argv)

    from specbatch.fast.loading import load_model

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    target, tokenizer = load_model(args.target)
    target_hidden = target.config.hidden_size
    features, train, valid = feature_examples(args, tokenizer)
    if args.init:
        draft = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        candidates = torch.tensor(json.loads((Path(args.init) / "output_tokens.json").read_text()))
    else:  # as train_draft.py: PCA embedding, the rest random; softmax over the tokens the answers use
        draft = new_draft(target, args.hidden, args.layers, args.intermediate, args.heads)
        candidates = torch.tensor(sorted({t for _, ids, first in train for t in ids[first:]}))
    del target
    scale = 1.0 / feature_rms(features, train)
    remap = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
    remap[candidates] = torch.arange(len(candidates))
    projection = torch.nn.Linear(target_hidden, draft.config.hidden_size, bias=False)
    torch.nn.init.zeros_(projection.weight)
    pad_id = draft.config.pad_token_id if draft.config.pad_token_id is not None else 0
    print(f"{len(train)} training / {len(valid)} validation examples; draft {sum(p.numel() for p in draft.parameters())} "
          f"parameters + projection {projection.weight.numel()}", flush=True)

    valid_batches = make_batches(valid, 4096, random.Random(0))

    @torch.no_grad()
    def validate():
        draft.eval()
        agree, total = [0, 0], 0  # with the feature, without it
        for batch in valid_batches:
            ids, attention, rows, positions, labels = collate(batch, pad_id)
            feats = feature_inputs(batch, features, ids.shape[1], target_hidden, scale)
            for which, f in enumerate((feats, torch.zeros_like(feats))):
                logits = logits_at(draft, projection, ids, attention, f, rows, positions, candidates)
                agree[which] += (candidates[logits.argmax(-1)] == labels).sum().item()
            total += labels.numel()
        draft.train()
        return round(agree[0] / total, 4), round(agree[1] / total, 4)

    start_agreement = validate()
    print(f"start: validation agreement with features {start_agreement[0]}, without {start_agreement[1]}", flush=True)
    steps_per_epoch = len(make_batches(train, args.tokens_per_batch, random.Random(0)))
    total_steps = max(1, int(steps_per_epoch * args.epochs))
    groups = [dict(params=list(draft.parameters()), lr=args.lr, peak=args.lr),
              dict(params=list(projection.parameters()), lr=args.projection_lr, peak=args.projection_lr)]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, betas=(0.9, 0.98))
    schedule = Schedule(total_steps, min(30, total_steps // 10), args.max_minutes)
    step, log = 0, []
    best = (start_agreement[0], 0, None)
    while not schedule.done(step):
        for batch in make_batches(train, args.tokens_per_batch, rng):
            ids, attention, rows, positions, labels = collate(batch, pad_id)
            feats = feature_inputs(batch, features, ids.shape[1], target_hidden, scale)
            keep = (torch.rand(feats.shape[:2]) >= args.feature_dropout).float()[..., None]
            for group in optimizer.param_groups:
                group["lr"] = group["peak"] * schedule.factor(step)
            logits = logits_at(draft, projection, ids, attention, feats * keep, rows, positions, candidates)
            loss = torch.nn.functional.cross_entropy(logits, remap[labels])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(draft.parameters()) + list(projection.parameters()), 1.0)
            optimizer.step()
            step += 1
            done = schedule.done(step)
            if step % 25 == 0 or done:
                entry = dict(step=step, loss=round(loss.item(), 4), minutes=round(schedule.elapsed() / 60, 2))
                if step % 100 == 0 or done:
                    entry["validation_with"], entry["validation_without"] = validate()
                    if entry["validation_with"] > best[0]:
                        best = (entry["validation_with"], step,
                                ({k: v.clone() for k, v in draft.state_dict().items()}, projection.weight.detach().clone()))
                log.append(entry)
                print(entry, flush=True)
            if done:
                break
    if best[2] is not None and best[1] != step:
        draft.load_state_dict(best[2][0])
        projection.weight.data.copy_(best[2][1])
    final = validate()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.float16).save_pretrained(out)
    (out / "output_tokens.json").write_text(json.dumps(candidates.tolist()) + "\n")
    torch.save((projection.weight.detach() * scale).to(torch.float16), out / "feature_projection.pt")  # reads raw f
    summary = dict(seed=args.seed, init=args.init, feature_scale=scale, training_examples=len(train), validation_examples=len(valid),
                   steps=step, epochs=round(step / steps_per_epoch, 2), lr=args.lr, projection_lr=args.projection_lr,
                   feature_dropout=args.feature_dropout, kept_step=best[1] if best[2] is not None else step,
                   wall_minutes=round(schedule.elapsed() / 60, 1), start_validation_with=start_agreement[0],
                   start_validation_without=start_agreement[1], validation_with=final[0], validation_without=final[1],
                   torch_threads=torch.get_num_threads(), log=log)
    (out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"validation agreement with features {final[0]:.3f}, without {final[1]:.3f}; saved to {out}")


if __name__ == "__main__":
    main()
