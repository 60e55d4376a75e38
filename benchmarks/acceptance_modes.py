"""Acceptance rate of rejection vs coupled sampling on the same (target, draft) pair.

    python benchmarks/acceptance_modes.py                       # tiny imposed pair, seconds
    python benchmarks/acceptance_modes.py --target smollm2 --draft truncated:8 --prompts FILE

For the imposed pair the expected per-draft acceptance is known: 1 - TV(p, q) for rejection
sampling and at least (1 - TV) / (1 + TV) for coupled sampling.
"""
import argparse

import numpy as np
import torch

import specbatch

def imposed_pair():
    from specbatch.fast.drafts.scripted import IMPOSED_P, IMPOSED_Q, ImposedLM
    return ImposedLM(IMPOSED_P), ImposedLM(IMPOSED_Q), [[0]] * 20000, IMPOSED_P, IMPOSED_Q


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--prompts")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--k", type=int, default=2)
    args = parser.parse_args()
    if args.target:
        from specbatch.prepare import encode_prompts, load, read_prompt_file
        target, draft, tok = load(args.target, args.draft)
        prompts = encode_prompts([t for _, t in read_prompt_file(args.prompts)], tok, True)
        note = ""
    else:
        target, draft, prompts, p, q = imposed_pair()
        tv = 0.5 * np.abs(p - q).sum(-1)
        note = (f" (imposed pair: mean TV {tv.mean():.3f}; 1 - TV = {1 - tv.mean():.3f}, "
                f"(1 - TV)/(1 + TV) = {((1 - tv) / (1 + tv)).mean():.3f}, averaged over contexts)")
    for mode in ("rejection", "coupled"):
        r = specbatch.generate(target, draft, prompts, max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k,
                               batch_size=min(len(prompts), 4000), temperature=args.temperature, sampling=mode,
                               eos_token_id=[] if not args.target else None)
        print(f"{mode:9s}: acceptance rate {r.stats['acceptance_rate']:.3f}, "
              f"mean accepted length {r.stats['mean_accepted_length']:.3f}")
    print("k =", args.k, note)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
