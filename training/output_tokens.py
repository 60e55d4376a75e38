"""The output tokens a distilled draft was trained over, from its training data, as train_draft.py
selects them (the answer tokens of the training examples, validation examples left out), written
to the draft's folder as output_tokens.json: the token set of its reduced head
(fast/drafts/reduced_head.py). train_draft.py writes the file itself; this recomputes it for a draft
trained before it did, from the same prompts and the target's regenerated answers.

    python training/output_tokens.py --prompts data/stage1.jsonl data/stage2.jsonl \
        --answers data/stage1_answers.jsonl data/stage2_answers.jsonl --out fast/distilled/smollm2-draft
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_draft import is_validation, load_examples  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", nargs="+", required=True)
    ap.add_argument("--answers", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--validation-share", type=float, default=0.04)
    args = ap.parse_args()
    from specbatch.fast.loading import load_model
    _, tokenizer = load_model(args.target)
    examples = load_examples(args.prompts, args.answers, tokenizer, args.max_len)
    train = [e for e in examples if not is_validation(e[0], args.validation_share)]
    used = sorted({t for _, ids, first in train for t in ids[first:]})
    log = json.loads((Path(args.out) / "training_log.json").read_text())
    print(f"{len(used)} output tokens in {len(train)} training examples (the training log says "
          f"{log.get('output_tokens_trained')} over {log.get('training_examples')} examples)")
    (Path(args.out) / "output_tokens.json").write_text(json.dumps(used) + "\n")


if __name__ == "__main__":
    main()
