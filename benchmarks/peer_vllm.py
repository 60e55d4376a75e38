"""Run vLLM (its CPU build, in its own virtual environment) on a prompt file, for `specbatch bench
--compare`: the same prompts, greedy, all submitted at once, and a result file specbatch reads.

    VLLM_VENV/bin/python benchmarks/peer_vllm.py --model MODEL_DIR --prompts prompts.jsonl \
        --per-category 1 --chat-template --max-new-tokens 128 --out vllm.jsonl \
        [--dtype float32|bfloat16] [--ngram | --draft DRAFT_DIR] [--k 4] [--eager] [--label NAME] \
        [--max-num-seqs N]   # N = 1: one request at a time (batch 1)

Output: a first line {"engine", "label", "seconds", "generated_tokens", ...} (seconds: the wall time
of the generate call, model loading excluded, as specbatch measures its own), then one line per
request {"id", "token_ids", "text"}. vLLM is never a dependency of specbatch: this script imports
only vLLM and the standard library. MODEL_DIR must be a plain Hugging Face folder (vLLM refuses a
config.json that keeps GGUF's quantization_config; specbatch's converted SmolLM2 folder has none).
"""
import argparse
import json
import os
import time


def read_prompts(path, per_category):
    rows = [json.loads(line) for line in open(path, encoding="utf-8-sig") if line.strip()]
    if per_category:
        seen, kept = {}, []
        for row in rows:
            category = row.get("category", "all")
            seen[category] = seen.get(category, 0) + 1
            if seen[category] <= per_category:
                kept.append(row)
        rows = kept
    out = []
    for i, row in enumerate(rows):
        text = row["prompt"] if isinstance(row.get("prompt"), str) else row["turns"][0]
        out.append((str(row.get("id", row.get("question_id", i))), text))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--chat-template", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ngram", action="store_true", help="n-gram (prompt lookup) speculation")
    ap.add_argument("--draft", help="draft model folder for draft-model speculation")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (no compiled graphs)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's cap on requests decoded together "
                    "(1: one at a time, batch 1; default: vLLM's)")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative = None
    if a.ngram:
        speculative = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 4}
    elif a.draft:
        speculative = {"method": "draft_model", "model": a.draft, "num_speculative_tokens": a.k}
    prompts = read_prompts(a.prompts, a.per_category)
    extra = {} if a.max_num_seqs is None else dict(max_num_seqs=a.max_num_seqs)
    llm = LLM(model=a.model, dtype=a.dtype, speculative_config=speculative, max_model_len=2048,
              enforce_eager=a.eager, seed=0, **extra)
    tokenizer = llm.get_tokenizer()
    inputs = []
    for _, text in prompts:
        if a.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        else:
            ids = tokenizer.encode(text)
        inputs.append(TokensPrompt(prompt_token_ids=ids))
    params = SamplingParams(temperature=0.0, max_tokens=a.max_new_tokens)
    start = time.perf_counter()
    outputs = llm.generate(inputs, params)
    seconds = time.perf_counter() - start
    mode = "ngram" if a.ngram else ("draft" if a.draft else "target-only")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    header = dict(engine=f"vllm {vllm.__version__}", label=a.label or f"vllm {mode}", mode=mode, dtype=a.dtype,
                  k=a.k if speculative else 0, eager=a.eager, seconds=seconds, generated_tokens=generated,
                  num_requests=len(prompts), max_num_seqs=a.max_num_seqs, load_average=os.getloadavg())
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for (ident, _), o in zip(prompts, outputs):
            f.write(json.dumps(dict(id=ident, token_ids=list(o.outputs[0].token_ids), text=o.outputs[0].text)) + "\n")
    print(f"{header['label']}: {generated} tokens in {seconds:.1f} s, {generated / seconds:.1f} tokens/s")


if __name__ == "__main__":
    main()
