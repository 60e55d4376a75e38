"""Prefill cost of a workload: packed (the engine's way), one prompt per forward, and the padded
rectangle the engine used before, all through the engine's forward path (its lean forward with the
native element-wise kernels, its attention, prepacked linear layers, K/V stored in the dtype the
engine stores them in) into the same slot cache, beside the floor: the linear
products of the engine's packs alone (each pack's tokens through every layer's prepacked products,
the head on one row per pack), and that plus the causal attention of each prompt alone (SDPA's kernel on
its own queries, keys and values, every layer), the two parts whose work grows with the tokens. The variants alternate, in reverse order every second repeat, and a
calibration before and after says whether the run may be quoted (specbatch.cli.calibration).

    python benchmarks/prefill_cost.py --target smollm2 --prompts prompts.jsonl --per-category 1 \
        --chat-template [--dtype bfloat16] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--chat-template", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from specbatch.cli import calibration
    from specbatch.cli.bench import select_prompts
    from specbatch.cli.machine import describe_machine
    from specbatch.prepare import encode_prompts
    from specbatch.fast.compute import prefill
    from specbatch.fast.compute.attention import engine_attention
    from specbatch.fast.engine import Settings
    from specbatch.fast.compute.kernels import prepacked_linears
    from specbatch.fast.loading import load_model
    from specbatch.fast.models import ModelRunner, mask_fill_value
    from specbatch.fast.compute.slot_cache import SlotCache
    from specbatch.fast.compute.slot_forward import ragged_inputs, storage_dtype

    model, tokenizer = load_model(args.target, args.dtype)
    prompts = select_prompts(args.prompts, args.per_category)
    contents = [p[:-1] for p in encode_prompts([t for _, t in prompts], tokenizer, args.chat_template)]
    dtype = next(model.parameters()).dtype
    settings = Settings(k=0, eos_ids=(), window=None, dtype=dtype, device=torch.device("cpu"),
                        fill=mask_fill_value(dtype))
    runner = ModelRunner(model, lean=True, native=True)  # as the engine runs it (both on by default)
    kv_dtype = storage_dtype(runner, settings)
    rows, width = len(contents), max(len(c) for c in contents)

    def packed(budget):
        def run():
            saved, prefill.PACK_TOKENS = prefill.PACK_TOKENS, budget
            try:
                cache = SlotCache(runner.num_layers, rows, width + 1, settings.device, kv_dtype)
                prefill.prefill_into(runner, cache, contents, list(range(rows)), [0] * rows, settings)
            finally:
                prefill.PACK_TOKENS = saved
        return run

    def rectangle():
        cache = SlotCache(runner.num_layers, rows, width + 1, settings.device, kv_dtype)
        query = torch.arange(width)[None, :] - (width - torch.tensor([len(c) for c in contents]))[:, None]
        ids = torch.tensor([[0] * (width - len(c)) + c for c in contents])
        cache.prepare(rows, query, width)
        pos, mask = ragged_inputs(query, width, None, dtype, settings.fill)
        runner(ids, pos, mask, cache, last_only=True)

    variants = {f"packed, {prefill.PACK_TOKENS}-token packs (the engine)": packed(prefill.PACK_TOKENS),
                "one prompt per forward": packed(1), "padded rectangle, one forward": rectangle}
    times = {name: [] for name in variants}
    leans = [runner.lean] if runner.lean is not None else []
    skip = [m for lean in leans for m in lean.replaced]
    with torch.inference_mode(), engine_attention(model), prepacked_linears(model, *leans, skip=skip):
        packed(prefill.PACK_TOKENS)()  # warm up (and prepack)
        pack_sizes = [sum(len(contents[i]) for i in pack) for pack in prefill.plan_packs([len(c) for c in contents])]
        before = calibration.calibrate()
        for repeat in range(args.repeats):
            for name in (list(variants) if repeat % 2 == 0 else list(variants)[::-1]):
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)
        floor = products_floor(leans[0] if leans else model, pack_sizes)
        attention = attention_floor(model.config, [len(c) for c in contents], dtype)
        after = calibration.calibrate()
    results = {name: statistics.median(t) for name, t in times.items()}
    real = sum(len(c) for c in contents)
    one = results["one prompt per forward"]
    print(f"{rows} prompts, {real} real tokens to prefill ({rows} x {width} = {rows * width} padded), {args.dtype}, "
          f"median of {args.repeats}, alternating; machine: {describe_machine()['summary']}\n")
    print(calibration.describe(before, after, calibration.verdict(before, after)) + "\n")
    both = floor + attention
    print("| prefill | seconds | vs one prompt per forward | vs the products of the engine's packs "
          "| vs those products and each prompt's attention |\n|---|---|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds:.2f} | {seconds / one:.2f}x | {seconds / floor:.2f}x | {seconds / both:.2f}x |")
    print(f"| the linear products of the engine's {len(pack_sizes)} packs alone | {floor:.2f} | | 1.00x | |")
    print(f"| those products and each prompt's causal attention alone ({attention:.2f} s) | {both:.2f} | "
          f"| {both / floor:.2f}x | 1.00x |")


def fastest(once, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of once(), after one to warm up."""
    once()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    return best


def products_floor(model, pack_sizes: list[int], repeats: int = 3) -> float:
    """Seconds of the linear products of a packed prefill alone: each pack's tokens through every
    linear layer of `model` but its output head (inside prepacked_linears: the engine's kernels),
    and the head on one row per pack (logits_to_keep=1); the fastest of `repeats` passes."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.head
    dtype = next(model.parameters()).dtype

    inputs = {(tokens, width): torch.randn(1, tokens, width, dtype=dtype)
              for tokens in set(pack_sizes) | {1} for width in {m.in_features for m in linears}}

    def once():
        for tokens in pack_sizes:
            for m in linears:
                m(inputs[(1 if m is head else tokens, m.in_features)])
    return fastest(once, repeats)


def attention_floor(config, lengths: list[int], dtype, repeats: int = 3) -> float:
    """Seconds of the causal attention of each prompt alone, every layer: SDPA's kernel on queries,
    keys and values of the prompt's length in `dtype` (what the engine's packed prefill computes per
    prompt, fast.compute.attention.segment_attention); the fastest of `repeats` passes."""
    import torch.nn.functional as F
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    shapes = [(torch.randn(1, heads, n, head_dim, dtype=dtype), torch.randn(1, kv_heads, n, head_dim, dtype=dtype),
               torch.randn(1, kv_heads, n, head_dim, dtype=dtype)) for n in lengths]

    def once():
        for _ in range(config.num_hidden_layers):
            for q, k, v in shapes:
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=head_dim ** -0.5,
                                               enable_gqa=heads != kv_heads)
    return fastest(once, repeats)


if __name__ == "__main__":
    main()
