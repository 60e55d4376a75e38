"""The speed half of the prepared device check (benchmarks/gpu_check.sh runs the tests first).

On the device it builds a random-initialised Llama in process (about 1.1B parameters, bfloat16 on
CUDA; --tiny: a few thousand, float32) and a self-draft cut from its own first layers
(`truncated:N`), and prints one table:
- the device test subset's result line (from --tests-log);
- the engine's target-only decode step against transformers' `generate` on the same device and
  against the memory-bandwidth floor (weight bytes / measured copy bandwidth), per batch size;
- the verify forward's time against its width (1..8 tokens per row), at batch 1;
- speculative (ragged, the self-draft) against target-only throughput per batch size, with the
  share of speculative outputs equal to target-only's.

    python benchmarks/gpu_check.py --device cuda --out gpu_check.json
    python benchmarks/gpu_check.py --device cpu --tiny          # the same steps at tiny sizes

Every figure is measured in this run; the JSON records the machine (specbatch.cli.machine).
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np
import torch

SIZES = {  # LlamaConfig fields; "full" is about 1.1B parameters
    "full": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def random_llama(size: str, dtype, device, draft_layers: int, late_scale: float):
    """A random Llama whose layers from `draft_layers` on write `late_scale` times their random
    output into the residual stream: a draft cut from its first layers then agrees with it part of
    the time, as a trained pair does (random layers at full scale would make it agree never)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=4096, eos_token_id=None, bos_token_id=1,
                         pad_token_id=0, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(late_scale)
            layer.mlp.down_proj.weight.mul_(late_scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def copy_bandwidth(device, megabytes: int) -> float:
    """Bytes per second moved by a device-to-device copy (bytes read plus bytes written), best of 5."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def prompts_for(batch: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts of 32..96 tokens: rows of different lengths, as a batch of requests has."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, int(n)).tolist() for n in rng.integers(32, 97, batch)]


def engine_step(target, prompts, new_tokens: int) -> tuple[float, list]:
    """Seconds per target-only decode step of specbatch's engine (verify time / rounds), and the outputs."""
    import specbatch
    specbatch.generate(target, None, prompts, max_new_tokens=4, batch_size=len(prompts))  # warm-up
    result = specbatch.generate(target, None, prompts, max_new_tokens=new_tokens, batch_size=len(prompts))
    return result.stats["time_verify"] / result.stats["rounds"], result


def hf_step(target, batch: int, new_tokens: int, device) -> float:
    """Seconds per decode step of transformers' generate at `batch` (equal 64-token prompts, no
    padding): the time of new_tokens steps less that of one, over new_tokens - 1."""
    ids = torch.randint(2, target.config.vocab_size, (batch, 64), generator=torch.Generator().manual_seed(batch))
    ids = ids.to(device)

    def timed(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - start
    timed(2)  # warm-up
    return (timed(new_tokens) - timed(1)) / (new_tokens - 1)


def verify_widths(target, device, widths, new_tokens: int) -> dict:
    """Seconds per verify forward at batch 1 with every proposal accepted (a draft that never
    deviates from the target's greedy tokens), per verify width (proposals + 1)."""
    import specbatch
    from specbatch.fast.drafts.scripted import ScriptedDraft
    never = lambda index, token: np.zeros(np.shape(index), dtype=bool)  # noqa: E731
    prompt = prompts_for(1, target.config.vocab_size, 99)
    out = {}
    for width in widths:
        options = dict(max_new_tokens=new_tokens, batch_size=1)
        if width == 1:
            result = specbatch.generate(target, None, prompt, **options)
        else:
            result = specbatch.generate(target, ScriptedDraft(target, never), prompt, num_draft_tokens=width - 1,
                                        policy="fixed", **options)
        out[width] = result.stats["time_verify"] / result.stats["rounds"]
    return out


def speculative(target, draft, prompts, new_tokens: int, plain, k: int) -> dict:
    import specbatch
    # a random draft's confidences mean nothing: every row proposes k tokens (policy fixed)
    options = dict(batch_size=len(prompts), strategy="ragged", num_draft_tokens=k, policy="fixed")
    specbatch.generate(target, draft, prompts, max_new_tokens=4, **options)
    result = specbatch.generate(target, draft, prompts, max_new_tokens=new_tokens, **options)
    return dict(tokens_per_second=result.stats["tokens_per_second"], tau=result.stats["mean_accepted_length"],
                **verdicts(target, prompts, result.sequences, plain.sequences))


def verdicts(target, prompts, sequences, references) -> dict:
    """How many speculative outputs equal target-only's, and how many differ only at a floating-point
    tie (fast.equivalence: the ulp rule of the model's dtype) or at an algorithmic error."""
    from specbatch.fast.equivalence import compare
    reports = compare(target, prompts, sequences, references)
    kinds = [r.get("kind", "exact") for r in reports]
    return dict(exact=f"{kinds.count('exact')}/{len(prompts)}", ties=kinds.count("tie"), errors=kinds.count("error"))


def tests_line(path) -> str:
    if not path or not Path(path).is_file():
        return "not run"
    lines = [line.strip("= \n") for line in Path(path).read_text(errors="replace").splitlines()
             if re.search(r"\d+ (passed|failed|error)", line)]
    return lines[-1] if lines else "no result line (see the log)"


def main() -> None:
    from specbatch.fast.loading import truncated_draft
    from specbatch.cli.machine import describe_machine
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a check of the script itself, e.g. on a CPU)")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--draft-layers", type=int, default=0, help="layers of the self-draft (default: a quarter)")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--late-scale", type=float, default=0.2,
                   help="scale of the residual writes of the layers the draft lacks (see random_llama)")
    p.add_argument("--tests-log", help="the device tests' pytest output (benchmarks/gpu_check.sh writes it)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    device, size = args.device, "tiny" if args.tiny else "full"
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    batches = [int(b) for b in args.batch_sizes.split(",")]
    machine = describe_machine(device)
    layers = args.draft_layers or max(1, SIZES[size]["num_hidden_layers"] // 4)
    target = random_llama(size, dtype, device, layers, args.late_scale)
    draft = truncated_draft(target, layers)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    bandwidth = copy_bandwidth(device, 1024 if torch.device(device).type == "cuda" else 256)
    floor = weight_bytes / bandwidth
    rows = []
    for batch in batches:
        prompts = prompts_for(batch, target.config.vocab_size, batch)
        step, plain = engine_step(target, prompts, args.new_tokens)
        hf = hf_step(target, batch, args.new_tokens, device)
        spec = speculative(target, draft, prompts, args.new_tokens, plain, args.k)
        rows.append(dict(batch=batch, engine_step_ms=1e3 * step, hf_step_ms=1e3 * hf, floor_ms=1e3 * floor,
                         target_only_tokens_per_second=plain.stats["tokens_per_second"], **spec))
    widths = verify_widths(target, device, range(1, 9), min(args.new_tokens, 48))
    report = dict(command="python benchmarks/gpu_check.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k}" for k, v in vars(args).items()
        if v not in (None, False, 0)), machine=machine, model=dict(size=size, parameters=sum(
            p.numel() for p in target.parameters()), dtype=str(dtype).replace("torch.", ""), draft_layers=layers,
            target_layers=target.config.num_hidden_layers), weight_bytes=weight_bytes,
        copy_bandwidth_bytes_per_s=bandwidth, tests=tests_line(args.tests_log), rows=rows,
        verify_ms_by_width={w: 1e3 * s for w, s in widths.items()}, cuda_graphs="not built")
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


def table(report: dict) -> str:
    m = report["model"]
    lines = [f"gpu_check on {report['machine']['summary']}",
             f"model: random Llama, {m['parameters'] / 1e6:.1f}M parameters in {m['dtype']}, {m['target_layers']} layers; "
             f"self-draft: its first {m['draft_layers']}; copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
             f"device tests: {report['tests']}", "",
             "| batch | engine step ms | transformers step ms | bandwidth floor ms | engine / floor | "
             "target-only tok/s | speculative tok/s | speculative / target-only | tau | exact | ties | errors | CUDA graphs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['batch']} | {r['engine_step_ms']:.2f} | {r['hf_step_ms']:.2f} | {r['floor_ms']:.3f} | "
                     f"{r['engine_step_ms'] / r['floor_ms']:.1f}x | {r['target_only_tokens_per_second']:.1f} | "
                     f"{r['tokens_per_second']:.1f} | {r['tokens_per_second'] / r['target_only_tokens_per_second']:.2f}x"
                     f" | {r['tau']:.2f} | {r['exact']} | {r.get('ties', '')} | {r.get('errors', '')} | {report['cuda_graphs']} |")
    widths = report["verify_ms_by_width"]
    lines += ["", "| verify width (tokens per row, batch 1) | " + " | ".join(str(w) for w in widths) + " |",
              "|---|" + "---|" * len(widths),
              "| ms per verify forward | " + " | ".join(f"{v:.2f}" for v in widths.values()) + " |"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
