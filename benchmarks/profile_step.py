"""Where a decoding step's time goes: the engine's target-only step against a bare forward.

Profiles `specbatch.generate` (ragged, target only) on a prompt file twice, with 2 and with
2 + STEPS new tokens, and subtracts the two runs' operator totals: what remains is STEPS decoding
steps, split into linear layers (matmul), attention, cache writes, masks/positions and the rest.
Beside it: a bare transformers forward (DynamicCache, no masks) at the same batch size and the
rows' mean context length, the floor for a step that runs the same layers.

    python benchmarks/profile_step.py --target smollm2 --prompts prompts.jsonl --per-category 1 \
        --chat-template [--dtype bfloat16] [--steps 32] [--batch-size 13]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

CATEGORIES = {  # operator name -> part of the step
    "aten::mm": "linear layers", "aten::addmm": "linear layers", "mkldnn::_linear_pointwise": "linear layers",
    "aten::bmm": "attention", "aten::baddbmm": "attention", "aten::_softmax": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::_scaled_dot_product_attention_math": "attention",
    "aten::index_copy_": "cache writes", "aten::index_put_": "cache writes",
    "aten::masked_fill_": "masks and positions", "aten::le": "masks and positions", "aten::gt": "masks and positions",
    "aten::index_select": "gathers", "aten::embedding": "embedding",
}


def load_ids(args):
    from specbatch.cli.bench import select_prompts
    from specbatch.prepare import encode_prompts
    from specbatch.fast.loading import load_model
    model, tokenizer = load_model(args.target, args.dtype)
    prompts = select_prompts(args.prompts, args.per_category)
    ids = encode_prompts([t for _, t in prompts], tokenizer, args.chat_template)[:args.batch_size]
    return model, ids


def op_times(model, ids, new_tokens):
    """Self CPU time per operator (ms) over one generate call, and its stats."""
    import specbatch
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = specbatch.generate(model, None, ids, max_new_tokens=new_tokens, batch_size=len(ids),
                                    strategy="ragged", eos_token_id=[])
    return {e.key: e.self_cpu_time_total / 1000 for e in prof.key_averages()}, result.stats


def bare_step(model, batch: int, context: int, repeats: int = 10) -> float:
    """Median ms of a plain transformers forward of one token per row over `context` cached tokens."""
    from transformers import DynamicCache
    ids = torch.randint(0, model.config.vocab_size, (batch, context))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            cache = DynamicCache()
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            start = time.perf_counter()
            model(input_ids=ids[:, :1], cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--chat-template", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=13)
    ap.add_argument("--show-ops", type=int, default=0, help="also list the N largest uncategorised operators")
    args = ap.parse_args()
    model, ids = load_ids(args)
    # warm up at the longer run's length: K/V buffers are kept between generations, and a first run
    # that needs larger ones pays for paging them in (it counted as some 13 ms of fill_ a step)
    op_times(model, ids, 2 + args.steps)
    # both runs decode (a 1-token run stops after the prefill and never allocates the decode cache,
    # whose zeroing would then count as STEPS steps' work)
    base, _ = op_times(model, ids, 2)
    full, stats = op_times(model, ids, 2 + args.steps)
    parts: dict = {}
    for name, ms in full.items():
        extra = (ms - base.get(name, 0.0)) / args.steps
        parts[CATEGORIES.get(name, "other operators")] = parts.get(CATEGORIES.get(name, "other operators"), 0.0) + extra
    import specbatch
    plain = specbatch.generate(model, None, ids, max_new_tokens=1 + args.steps, batch_size=len(ids),
                               strategy="ragged", eos_token_id=[]).stats  # wall time without the profiler
    step = 1000 * plain["time_verify"] / plain["rounds"]
    mean_context = int(sum(len(p) for p in ids) / len(ids) + args.steps / 2)
    bare = bare_step(model, len(ids), mean_context)
    print(f"batch {len(ids)}, {args.dtype}, {args.steps} steps; engine step {step:.1f} ms (wall, no profiler, mean over "
          f"{plain['rounds']} rounds); bare transformers forward at context {mean_context}: {bare:.1f} ms\n")
    print("operators per step (profiled; the rest of the wall time is Python and framework overhead):\n")
    print("| part of a step | ms |\n|---|---|")
    for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {ms:.1f} |")
    print(f"| operators in all | {sum(parts.values()):.1f} |")
    if args.show_ops:
        others = sorted(((ms - base.get(name, 0.0)) / args.steps, name) for name, ms in full.items()
                        if name not in CATEGORIES)[::-1][:args.show_ops]
        print("\nlargest other operators (ms per step): " + ", ".join(f"{n} {ms:.2f}" for ms, n in others))


if __name__ == "__main__":
    main()
