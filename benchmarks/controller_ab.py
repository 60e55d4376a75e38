"""The parts of speculation that pays, switched off one at a time, side by side in one process.

Variants (ragged, the default draft and options unless named):
  ar            target-only decoding (the baseline, same engine)
  default       everything on
  no-controller the threshold alone decides how far a row drafts (generate(..., adaptive=False))
  no-lookup-rows  rows whose lookup matches still run the draft model (the behaviour before lookup rows)
  all-valued    every row's accepted token valued at a plain round's share even with nobody waiting
  no-ledger     drafting never turned off by the ledger of whole drafting rounds (fast.proposals.RoundLedger)
  ledger-everywhere  the ledger also acts below DraftController.LEDGER_FROM_ROWS rows
  fixed-probes  the ledger's probes every PROBE_EVERY rounds while it loses (no backoff)
  no-plain-anchor  no plain rounds measured at the start (the verify cost fitted through drafting rounds)
  full-vocab-steps  draft steps as before SubsetLogits: whole-vocabulary logits, and the lookup-first
                draft runs its own lookup besides the engine's (the same proposals)
  min-match-3   prompt lookup proposes only where 3 or more tokens match, at every batch size (the
                lookup-first draft's min_match; its default is 2)
  short-lookup  the lookup's 2-token matches propose at every batch size (the controller does not ask
                for 3 matching tokens from DraftController.LONG_MATCH_FROM_ROWS rows up)
  floor-everywhere  the floor (draft_floor: a row proposes the token of the step that stops it when its
                confidence is at least the floor) at every batch size (the controller raises the round's floor
                to the threshold from DraftController.FLOOR_BELOW_ROWS rows up)
  all-draft-rows  the feature head computes every row at every draft step (before it computed only the
                rows still drafting by the model; the same proposals up to rounding)
  valued-floor  each row's floor from what its accepted token is worth: clip(2 x seconds of a verify token /
                the row's token value, draft_floor, threshold) from DraftController.FLOOR_BELOW_ROWS rows up
  padded-rows   two-row products padded to three rows (fast.kernels.PADDED_ROWS as on AVX-512 CPUs)
  threshold-T   the default with draft_threshold T (e.g. threshold-0.5)
  k-N           the default with N draft tokens (num_draft_tokens; e.g. k-6)
  floor-everywhere-F  floor-everywhere with draft_floor F (e.g. floor-everywhere-0: every row whose cap
                allows a proposal proposes its first token whatever its confidence)
  fixed-kN-tT-fF  no controller (adaptive=False): every row drafts up to N tokens by the threshold T and
                the floor F alone, at every row count (e.g. fixed-k1-t0-f0: every row proposes exactly
                one token every round)
Variants alternate inside each repeat (in reverse order every second repeat), so machine drift
touches them alike; each line is one run.

    python benchmarks/controller_ab.py --target smollm2 --prompts question.jsonl --per-category 1 \
        --chat-template --batch-size 13 --repeats 2 [--variants ar,default,no-controller]
"""
from __future__ import annotations

import argparse
import re
import time
from contextlib import contextmanager

VARIANTS = ("ar", "default", "no-controller", "no-lookup-rows", "all-valued", "no-ledger", "ledger-everywhere",
            "fixed-probes", "no-plain-anchor", "full-vocab-steps", "all-draft-rows", "min-match-3",
            "short-lookup", "floor-everywhere", "valued-floor", "padded-rows")


@contextmanager
def variant(name: str, draft=None):
    """Patch the engine (and the draft) for one variant (the patches are undone afterwards)."""
    import numpy as np

    from specbatch.fast import kernels
    from specbatch.fast.lookup_draft import LookupFirstDraft
    from specbatch.fast.proposals import DraftController, RoundLedger
    from specbatch.fast.strategies.ragged import RaggedEngine
    if name == "min-match-3" and not isinstance(draft, LookupFirstDraft):
        raise SystemExit("min-match-3 needs a draft with prompt lookup in front (...+lookup)")
    init, values = RaggedEngine.__init__, DraftController.token_values

    def engine_with(attribute, value):
        def patched(self, *args, **kwargs):
            init(self, *args, **kwargs)
            setattr(self, attribute, value)
        return patched

    def all_valued(self, rows, overhead, remaining=None, waiting=True):
        return values(self, rows, overhead, remaining, True)

    def valued_floor(self, rows, floor, threshold):
        if not (self.adaptive and self.k) or rows < self.FLOOR_BELOW_ROWS:
            return floor
        if self.values is None or len(self.values) != rows:
            return threshold
        token_seconds = self.verify_cost(rows + 1) - self.verify_cost(rows)
        return np.clip(2 * token_seconds / np.maximum(self.values, 1e-12), floor, threshold)

    patches = {  # variant -> (owner, attribute, value while it runs)
        "no-lookup-rows": [(RaggedEngine, "__init__", engine_with("lookup", None))],
        "full-vocab-steps": [(RaggedEngine, "__init__", engine_with("draft_options", {}))],  # read, never written
        "all-draft-rows": [(RaggedEngine, "__init__", engine_with("draft_row_subset", False))],
        "all-valued": [(DraftController, "token_values", all_valued)],
        "no-ledger": [(RoundLedger, "losing", lambda self: False)],
        "ledger-everywhere": [(DraftController, "LEDGER_FROM_ROWS", 1)],
        "short-lookup": [(DraftController, "LONG_MATCH_FROM_ROWS", 10 ** 9)],
        "floor-everywhere": [(DraftController, "FLOOR_BELOW_ROWS", 10 ** 9)],
        "valued-floor": [(DraftController, "round_floor", valued_floor)],
        "padded-rows": [(kernels, "PADDED_ROWS", kernels.padded_rows_for("AVX512"))],
        "no-plain-anchor": [(DraftController, "PLAIN_SAMPLES", 0)],
        "fixed-probes": [(DraftController, "PROBE_LIMIT", DraftController.PROBE_EVERY)],
        "min-match-3": [(draft, "min_match", 3)],
    }.get("floor-everywhere" if name.startswith("floor-everywhere-") else name, [])
    saved = [(owner, attribute, vars(owner).get(attribute)) for owner, attribute, _ in patches]
    try:
        for owner, attribute, value in patches:
            setattr(owner, attribute, value)
        yield
    finally:
        for owner, attribute, value in saved:
            setattr(owner, attribute, value)


PARAMETRISED = {  # variant name pattern -> generate()'s options from its numbers
    r"threshold-([\d.]+)": lambda t: dict(draft_threshold=float(t)),
    r"k-(\d+)": lambda n: dict(num_draft_tokens=int(n)),
    r"floor-everywhere-([\d.]+)": lambda f: dict(draft_floor=float(f)),
    r"fixed-k(\d+)-t([\d.]+)-f([\d.]+)": lambda n, t, f: dict(
        num_draft_tokens=int(n), draft_threshold=float(t), draft_floor=float(f), adaptive=False),
}


def variant_options(name: str) -> dict | None:
    """generate()'s options for a variant: {} for a named one, its numbers' options for a
    parametrised one (PARAMETRISED), None for an unknown name."""
    if name in VARIANTS:
        return {"adaptive": False} if name == "no-controller" else {}
    for pattern, options in PARAMETRISED.items():
        match = re.fullmatch(pattern, name)
        if match:
            return options(*match.groups())
    return None


def main() -> None:
    from specbatch import generate
    from specbatch.bench import select_prompts
    from specbatch.fast.loading import load_draft, load_model
    from specbatch.prepare import encode_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default="smollm2-draft+lookup")
    p.add_argument("--prompts", required=True)
    p.add_argument("--per-category", type=int, default=0)
    p.add_argument("--chat-template", action="store_true")
    p.add_argument("--batch-size", type=int, default=13)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--variants", default="ar,default,no-controller,no-lookup-rows,all-valued")
    p.add_argument("--controller-off", action="store_true",
                   help="every variant with adaptive=False: the rounds are a function of the prompts alone, so "
                        "variants that only change how a step is computed run the very same rounds")
    args = p.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if variant_options(v) is None]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}; expected some of {', '.join(VARIANTS)}, or threshold-T, k-N, "
                "floor-everywhere-F, fixed-kN-tT-fF")
    target, tokenizer = load_model(args.target, "float32")
    draft, _ = load_draft(args.draft, target, "float32")
    ids = encode_prompts([text for _, text in select_prompts(args.prompts, args.per_category)], tokenizer,
                         args.chat_template)
    reference = None
    print("| repeat | variant | batch | tokens/s | exact | rounds | lookup rounds | τ | draft s | verify s | prefill s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:  # drift cancels in pairs of repeats
            options = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, **variant_options(name))
            if args.controller_off:
                options["adaptive"] = False
            with variant(name, draft):
                start = time.perf_counter()
                result = generate(target, None if name == "ar" else draft, ids, **options)
                seconds = time.perf_counter() - start
            reference = reference or result.sequences
            s = result.stats
            exact = sum(a == b for a, b in zip(result.sequences, reference))
            print(f"| {repeat + 1} | {name} | {args.batch_size} | {sum(map(len, result.sequences)) / seconds:.1f} | "
                  f"{exact}/{len(ids)} | {s['rounds']} | {s['lookup_rounds']} | {s['mean_accepted_length']:.2f} | "
                  f"{s['time_draft']:.2f} | {s['time_verify']:.2f} | {s['time_prefill']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
