"""The target's final hidden states (after its last norm, the input of its LM head) over the
distillation examples: the training data of a feature-conditioned draft (training/train_feature_draft.py).

    python training/target_features.py --prompts training/data/stage1.jsonl training/data/stage2.jsonl \
        --answers training/data/stage1_answers.jsonl training/data/stage2_answers.jsonl \
        --out training/data/features.pt

Writes {id: float16 tensor [len(ids), hidden]} for every example of train_draft.load_examples
(prompt + answer, the same cut), one forward per example.
"""
from __future__ import annotations

import argparse
import time

import torch

from train_draft import data_arguments, is_validation, load_examples


def feature_arguments(parser) -> None:
    """The arguments the feature-draft trainers share: train_draft's data arguments, this script's
    output, the run's length and the validation split."""
    data_arguments(parser)
    parser.add_argument("--features", required=True, help="this script's output for the same examples")
    parser.add_argument("--epochs", type=float, default=4.0)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--validation-share", type=float, default=0.04)
    parser.add_argument("--seed", type=int, default=0)


def feature_examples(args, tokenizer) -> tuple[dict, list, list]:
    """(features, training examples, validation examples): train_draft.load_examples' examples that
    have features, split as train_draft.py splits them."""
    features = torch.load(args.features)
    examples = [e for e in load_examples(args.prompts, args.answers, tokenizer, args.max_len) if e[0] in features]
    train = [e for e in examples if not is_validation(e[0], args.validation_share)]
    valid = [e for e in examples if is_validation(e[0], args.validation_share)]
    return features, train, valid


def log_step(entry: dict, log: list, net, best: tuple, validate, validating: bool) -> tuple:
    """Append a training log entry (with the validation agreement of both draft steps when
    `validating`) and print it; returns best, (step-1 agreement, step, weights) of the best
    validation so far."""
    if validating:
        entry["validation_step1"], entry["validation_step2"] = validate()
        if entry["validation_step1"] > best[0]:
            best = (entry["validation_step1"], entry["step"], {k: v.clone() for k, v in net.state_dict().items()})
    log.append(entry)
    print(entry, flush=True)
    return best


def feature_rms(features: dict, examples: list, count: int = 50) -> float:
    """The root mean square of the features of the first `count` examples."""
    return torch.cat([features[e[0]].float() for e in examples[:count]]).pow(2).mean().sqrt().item()


@torch.no_grad()
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data_arguments(parser)
    args = parser.parse_args(argv)
    from specbatch.fast.loading import load_model

    target, tokenizer = load_model(args.target)
    target.eval()
    examples = load_examples(args.prompts, args.answers, tokenizer, args.max_len)
    features, start = {}, time.time()
    for i, (ident, ids, _) in enumerate(sorted(examples, key=lambda e: len(e[1]))):
        hidden = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        features[ident] = hidden.to(torch.float16)
        if i % 100 == 0:
            print(f"{i}/{len(examples)} examples, {time.time() - start:.0f} s", flush=True)
    torch.save(features, args.out)
    print(f"{len(features)} examples in {time.time() - start:.0f} s; saved to {args.out}")


if __name__ == "__main__":
    main()
