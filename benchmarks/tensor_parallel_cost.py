"""What tensor parallelism costs on this machine: one process on every core against torchrun
--tensor-parallel 2 (two processes, half the cores each), alternating, same prompts and settings.

The target has SmolLM2-135M-Instruct's shape (Llama, 30 layers, width 576, 49,152 tokens) with 8
attention heads and 2 key/value heads, since SmolLM2's 9 and 3 do not divide between 2 ranks;
its weights are random (seeded), and SmolLM2's tokenizer encodes the prompts. Both runs decode the
same tokens, so the ratio of their generation rates (model loading excluded) is the cost.

    python benchmarks/tensor_parallel_cost.py --out docs/results/tensor-parallel
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RATE = re.compile(r"(\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s\)")


def make_target(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specbatch.fast.loading import load_smollm2
    _, tokenizer = load_smollm2(torch.float32)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run(command: list[str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{done.stderr[-3000:]}")
    tokens, seconds, rate = RATE.findall(done.stderr)[0]
    return dict(tokens=int(tokens), seconds=float(seconds), tokens_per_second=float(rate))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for results.json and results.md")
    parser.add_argument("--prompts", default=str(Path(__file__).with_name("instructions.txt")))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from specbatch.cli.machine import describe_machine
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "target"
        make_target(target)
        common = ["-m", "specbatch", "generate", "--target", str(target), "--prompts", args.prompts,
                  "--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(args.batch_size),
                  "--dtype", "float32"]
        layouts = {"one process": [sys.executable, *common],
                   "tensor parallel 2": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                         *common, "--tensor-parallel", "2"]}
        rows = []
        for repeat in range(args.repeats):
            names = list(layouts) if repeat % 2 == 0 else list(layouts)[::-1]  # alternate the order
            measured = {name: run(layouts[name]) for name in names}
            rows.append(dict(repeat=repeat, **{name: measured[name] for name in layouts},
                             ratio=measured["tensor parallel 2"]["tokens_per_second"]
                             / measured["one process"]["tokens_per_second"]))
            print(f"repeat {repeat}: " + ", ".join(f"{name} {measured[name]['tokens_per_second']:.1f} tok/s"
                                                  for name in layouts) + f", ratio {rows[-1]['ratio']:.2f}")
    machine = describe_machine()
    result = dict(command=" ".join(["python", *sys.argv]), machine=machine, max_new_tokens=args.max_new_tokens,
                  batch_size=args.batch_size, prompts=args.prompts, rows=rows)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"Command: `{result['command']}`", "", f"Machine: {machine['summary']}", "",
             "| repeat | one process (tok/s) | tensor parallel 2 (tok/s) | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['repeat']} | {r['one process']['tokens_per_second']:.1f} | "
              f"{r['tensor parallel 2']['tokens_per_second']:.1f} | {r['ratio']:.2f} |" for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
