"""Prefill cost of a workload: packed (the engine's way), one prompt per forward, and the padded
rectangle the engine used before, all through the same forward path (engine attention, prepacked
linear layers) into the same slot cache.

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
    from specbatch.cli.bench import select_prompts
    from specbatch.prepare import encode_prompts
    from specbatch.fast.compute import prefill
    from specbatch.fast.compute.attention import engine_attention
    from specbatch.fast.engine import Settings
    from specbatch.fast.compute.kernels import prepacked_linears
    from specbatch.fast.loading import load_model
    from specbatch.fast.models import ModelRunner, mask_fill_value
    from specbatch.fast.compute.slot_cache import SlotCache
    from specbatch.fast.compute.slot_forward import ragged_inputs

    model, tokenizer = load_model(args.target, args.dtype)
    prompts = select_prompts(args.prompts, args.per_category)
    contents = [p[:-1] for p in encode_prompts([t for _, t in prompts], tokenizer, args.chat_template)]
    dtype = next(model.parameters()).dtype
    settings = Settings(k=0, eos_ids=(), window=None, dtype=dtype, device=torch.device("cpu"),
                        fill=mask_fill_value(dtype))
    runner = ModelRunner(model)
    rows, width = len(contents), max(len(c) for c in contents)

    def packed(budget):
        def run():
            saved, prefill.PACK_TOKENS = prefill.PACK_TOKENS, budget
            try:
                cache = SlotCache(runner.num_layers, rows, width + 1, settings.device)
                prefill.prefill_into(runner, cache, contents, list(range(rows)), [0] * rows, settings)
            finally:
                prefill.PACK_TOKENS = saved
        return run

    def rectangle():
        cache = SlotCache(runner.num_layers, rows, width + 1, settings.device)
        query = torch.arange(width)[None, :] - (width - torch.tensor([len(c) for c in contents]))[:, None]
        ids = torch.tensor([[0] * (width - len(c)) + c for c in contents])
        cache.prepare(rows, query, width)
        pos, mask = ragged_inputs(query, width, None, dtype, settings.fill)
        runner(ids, pos, mask, cache, last_only=True)

    results = {}
    with torch.inference_mode(), engine_attention(model), prepacked_linears(model):
        packed(prefill.PACK_TOKENS)()  # warm up (and prepack)
        for name, run in ((f"packed, {prefill.PACK_TOKENS}-token packs (the engine)", packed(prefill.PACK_TOKENS)),
                          ("one prompt per forward", packed(1)), ("padded rectangle, one forward", rectangle)):
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            results[name] = statistics.median(times)
    real = sum(len(c) for c in contents)
    one = results["one prompt per forward"]
    print(f"{rows} prompts, {real} real tokens to prefill ({rows} x {width} = {rows * width} padded), {args.dtype}, "
          f"median of {args.repeats}\n")
    print("| prefill | seconds | vs one prompt per forward |\n|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds:.2f} | {seconds / one:.2f}x |")


if __name__ == "__main__":
    main()
