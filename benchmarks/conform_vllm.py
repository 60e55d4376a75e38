"""Run specbatch's conformance vectors through vLLM (its CPU build, in its own virtual environment)
and write outputs that `specbatch conform check` reads.

    specbatch conform make --target smollm2 --out vectors/
    VLLM_VENV/bin/python benchmarks/conform_vllm.py --model MODEL_DIR --vectors vectors/ \
        --out vllm_outputs.jsonl [--ngram | --draft DRAFT_DIR] [--k 4] [--max-num-seqs 4] [--order shuffled]
    specbatch conform check vectors/ vllm_outputs.jsonl

Processor vectors (benchmarks/conform_processors.py writes OUT/vectors.json): --vectors OUT/vectors.json,
every request at once in file order with its repetition, presence and frequency penalties, logit
bias and min_tokens; judged by `python benchmarks/conform_processors.py --out OUT --check OUTPUTS --name NAME`.

Sampled vectors (`conform make --sampled`, with `--processors` too): each setting's rows are submitted
at once, in file order, each with its own temperature, top-k, top-p, processors and seed (`specbatch conform check vectors/ vllm_outputs.jsonl
--target MODEL` judges the distribution). Greedy vectors:
all requests are submitted at once in the chosen order (the manifest's suggested orders);
--max-num-seqs bounds how many vLLM batches together, so small values make it admit new requests
while others run (continuous batching mixes lengths). Greedy, each request's max_new_tokens and the
vectors' EOS ids as stop tokens. Imports only vLLM and the standard library (vLLM is never a
dependency of specbatch).
"""
import argparse
import json
import os
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--vectors", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default=None, help="default: the vectors' dtype")
    ap.add_argument("--ngram", action="store_true")
    ap.add_argument("--draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--order", default="shuffled", choices=("input", "reversed", "shuffled"))
    ap.add_argument("--no-request-seeds", action="store_true", help="sampled vectors: leave each row's seed out "
                    "(vLLM's CPU build refuses per-request seeds: 'CPU Generator does not use offset'); rows then "
                    "draw from the engine's own stream, seeded once with 0")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile warm-up)")
    ap.add_argument("--without", default="", help="processor vectors: leave out the requests with these settings "
                    "(comma-separated), which vLLM refuses in this mode (speculation: logit_bias)")
    ap.add_argument("--samples", type=int, help="sampled vectors: only the first N samples of each request")
    ap.add_argument("--settings", help="sampled vectors: only these settings (comma-separated names)")
    ap.add_argument("--logprobs", type=int, default=0, help="ask for N logprobs per token and write each chosen "
                    "token's as `logprobs` (conform check --logprobs raw judges them; vLLM's are raw by default)")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    processors = a.vectors.endswith(".json")  # processor vectors: one file (benchmarks/conform_processors.py)
    if processors:
        data = json.load(open(a.vectors))
        manifest = data["manifest"]
        requests = [r for r in data["requests"] if not set(r["settings"]) & set(filter(None, a.without.split(",")))]
        manifest["suggested"] = dict(orders=dict(input=list(range(len(requests)))))
        a.order = "input"
    else:
        manifest = json.load(open(os.path.join(a.vectors, "manifest.json")))
        requests = [json.loads(line) for line in open(os.path.join(
            a.vectors, "rows.jsonl" if manifest.get("format") == "specbatch-sampled" else "requests.jsonl"))
            if line.strip()]
    sampled = manifest.get("format") == "specbatch-sampled"
    if sampled and a.samples:
        requests = [r for r in requests if r["sample"] < a.samples]
    if sampled and a.settings:
        requests = [r for r in requests if r["setting"] in a.settings.split(",")]
    order = list(range(len(requests))) if sampled else manifest["suggested"]["orders"][a.order]
    speculative = None
    if a.ngram:
        speculative = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    elif a.draft:
        speculative = {"method": "draft_model", "model": a.draft, "num_speculative_tokens": a.k}
    llm = LLM(model=a.model, dtype=a.dtype or manifest["dtype"], speculative_config=speculative, max_model_len=2048,
              max_num_seqs=a.max_num_seqs, seed=0, enforce_eager=a.eager)
    eos = manifest["eos_token_ids"]
    chosen = [requests[i] for i in order]

    def params(r):
        if processors:  # each request's penalties, logit bias and min_tokens (vLLM's names are the same)
            settings = dict(r["settings"])
            if "logit_bias" in settings:
                settings["logit_bias"] = {int(t): float(v) for t, v in settings["logit_bias"].items()}
            return SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"], stop_token_ids=eos, **settings)
        if not sampled:
            return SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"], stop_token_ids=eos)
        extra = dict(top_k=r["top_k"]) if r["top_k"] else {}
        if not a.no_request_seeds:
            extra["seed"] = r["seed"]
        for key in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "min_tokens"):
            if r.get(key) is not None:  # sampled processor vectors (conform make --sampled --processors)
                extra[key] = r[key]
        if r.get("logit_bias"):
            extra["logit_bias"] = {int(t): float(v) for t, v in r["logit_bias"].items()}
        if a.logprobs:
            extra["logprobs"] = a.logprobs
        return SamplingParams(temperature=r["temperature"], top_p=r["top_p"] or 1.0,
                              max_tokens=r["max_new_tokens"], stop_token_ids=eos, **extra)
    groups = [[r for r in chosen if r["setting"] == s["name"]] for s in manifest["settings"]] if sampled else [chosen]
    start = time.perf_counter()
    outputs = []
    for group in groups:
        outputs += llm.generate([TokensPrompt(prompt_token_ids=r["token_ids"]) for r in group],
                                [params(r) for r in group])
    chosen = [r for group in groups for r in group]
    seconds = time.perf_counter() - start
    with open(a.out, "w", encoding="utf-8") as f:
        for r, o in zip(chosen, outputs):
            tokens = list(o.outputs[0].token_ids)
            if o.outputs[0].finish_reason == "stop" and (not tokens or tokens[-1] not in eos) and o.outputs[0].stop_reason in eos:
                tokens.append(o.outputs[0].stop_reason)  # the EOS that stopped it, kept as the oracle keeps it
            row = dict(id=r["id"], token_ids=tokens)
            if a.logprobs and o.outputs[0].logprobs is not None:  # the chosen token's, at each position vLLM returned
                row["logprobs"] = [step[t].logprob for t, step in zip(tokens, o.outputs[0].logprobs)]
            f.write(json.dumps(row) + "\n")
    mode = "ngram" if a.ngram else ("draft" if a.draft else "target-only")
    print(f"vllm {mode}, max_num_seqs {a.max_num_seqs}, {'file' if sampled else a.order} order: {len(chosen)} "
          f"requests in {seconds:.1f} s")


if __name__ == "__main__":
    main()
