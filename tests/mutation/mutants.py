"""Single-point mutants of the torch engine (and the schedulers it shares with the reference), each
the kind of one-line bug a contributor could write. tests/mutation/run.py applies them one at a time
and runs the listed tests; every mutant here changes outputs or reported statistics, so every one
must be killed.

Each entry: (id, area, file, original text, mutated text, tests to run). The original text must
occur exactly once in the file.
"""

ENGINE = ["tests/test_fast_engine.py", "tests/test_fast_errors_and_checks.py"]
RAGGED = ["tests/test_fast_engine.py", "tests/test_prefill_and_attention.py"]
SAMPLING = ["tests/test_sampling.py"]
LOOKUP = ["tests/test_lookup_draft.py"]
PROPOSALS = ["tests/test_proposals.py"]
POLICY = ["tests/test_policy.py"]
SCHEDULING = ["tests/test_scheduling.py", "tests/test_fast_engine.py"]
FEATURES = ["tests/test_feature_draft.py"]
KERNELS = ["tests/test_kernels.py"]
OPTIONS = ["tests/test_options.py"]
HOSTILE = ["tests/test_hostile_files.py"]
BACKEND = ["tests/test_backend.py"]
SAMPLED = ["tests/test_sampled.py"]
TENSOR_PARALLEL = ["tests/test_tensor_parallel.py"]
SERVER = ["tests/test_server_adapter.py"]
CONFORM = ["tests/test_conform.py"]

MUTANTS = [
    # ---- masks
    ("mask-no-self", "masks", "fast/cache.py",
     "(slot[:, None, :] >= 0) & (slot[:, None, :] <= query[:, :, None])",
     "(slot[:, None, :] >= 0) & (slot[:, None, :] < query[:, :, None])", ENGINE),
    ("mask-sees-a-pad", "masks", "fast/cache.py",
     "(slot[:, None, :] >= 0) & (slot[:, None, :] <= query[:, :, None])",
     "(slot[:, None, :] >= -1) & (slot[:, None, :] <= query[:, :, None])", ENGINE),
    ("mask-window-off-by-one", "masks", "fast/cache.py",
     "visible &= slot[:, None, :] > query[:, :, None] - window",
     "visible &= slot[:, None, :] >= query[:, :, None] - window", ENGINE),
    ("ragged-mask-sees-future", "masks", "fast/slot_forward.py",
     "    visible = slot <= q\n", "    visible = slot <= q + 1\n", RAGGED),
    ("flat-mask-sees-future", "masks", "fast/attention.py",
     "seen = (slot <= query[:, :, None]) & real[:, :, None]",
     "seen = (slot <= query[:, :, None] + 1) & real[:, :, None]", RAGGED),
    ("flat-layout-position-off-by-one", "positions", "fast/layout.py",
     "content[token_row] - 1 + column", "content[token_row] + column", RAGGED + ["tests/test_layout.py"]),
    ("packed-prefill-across-prompts", "masks", "fast/prefill.py",
     "visible = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])",
     "visible = (segment[:, None] >= segment[None, :]) & (position[None, :] <= position[:, None])", RAGGED),
    # ---- positions
    ("rect-positions-shifted", "positions", "fast/cache.py",
     "return query.clamp(min=0), mask[:, None]", "return (query + 1).clamp(min=0), mask[:, None]", ENGINE),
    ("ragged-draft-step-position", "positions", "fast/proposer.py",
     "query_index = content[:, None] + step - 1", "query_index = content[:, None] + step", RAGGED),
    ("ragged-verify-position", "positions", "fast/strategies/ragged.py",
     "query_index = content[:, None] - 1 + np.arange(width)[None, :]",
     "query_index = content[:, None] + np.arange(width)[None, :]", RAGGED),
    # ---- cache edits
    ("eqspec-crop-not-realign", "cache", "fast/strategies/eqspec.py",
     "gather_cache(self.target_cache, rows, source, new_width - 1)",
     "gather_cache(self.target_cache, rows, None, new_width - 1)", ENGINE),
    ("eqspec-shift-sign", "cache", "fast/strategies/eqspec.py",
     "- torch.as_tensor(delta, device=self.settings.device)[:, None]).clamp(min=0)",
     "+ torch.as_tensor(delta, device=self.settings.device)[:, None]).clamp(min=0)", ENGINE),
    # (Not listed: a pad query writing into slot 0 instead of the trash slot. The ragged engine no
    # longer issues pad queries, since packed prefill, so that mutant cannot change anything; the
    # harness reported it as surviving, which is how this was found.)
    # (count - 1 would be equivalent: every verify rewrites the K/V of a row's last content token.)
    ("compaction-moves-two-slots-short", "cache", "fast/strategies/ragged.py",
     "side.move_row(src, dst, count)", "side.move_row(src, dst, count - 2)", RAGGED),
    ("compaction-forgets-draft-pending", "cache", "fast/proposer.py",
     "        self.pending[dst] = self.pending[src]\n", "", RAGGED + ["tests/test_engine_state_machine.py"]),
    ("slot-write-one-slot-late", "cache", "fast/slot_cache.py",
     "* capacity + index[:, None, :]).reshape(-1)", "* capacity + index[:, None, :] + 1).reshape(-1)", RAGGED),
    ("draft-pending-after-full-accept", "cache", "fast/verify.py",
     "return n - np.minimum(np.minimum(accepted, k - 1), n)", "return n - np.minimum(accepted, n)", ENGINE),
    # ---- acceptance
    ("accept-past-own-proposal", "acceptance", "fast/verify.py",
     "(torch.arange(k, device=drafted.device)[None, :] < limit[:, None])",
     "(torch.arange(k, device=drafted.device)[None, :] <= limit[:, None])", PROPOSALS + ENGINE),
    ("accept-not-a-prefix", "acceptance", "fast/verify.py",
     "return agree.long().cumprod(dim=1).sum(dim=1)", "return agree.long().sum(dim=1)", ENGINE),
    ("rejection-ratio-inverted", "acceptance", "fast/sampling.py",
     "ok = (u * q_d < p_d)", "ok = (u * p_d < q_d)", SAMPLING),
    ("residual-is-p", "acceptance", "fast/sampling.py",
     "r = (p - q).clamp(min=0)", "r = p.clamp(min=0)", SAMPLING),
    # ---- EOS
    ("eos-not-kept", "eos", "fast/verify.py",
     "return torch.where(hit, first + 1, n), hit", "return torch.where(hit, first, n), hit", ENGINE),
    ("eos-one-past-the-commit", "eos", "fast/verify.py",
     "hit = first < n", "hit = first <= n", ENGINE),
    ("eos-ignored-in-ragged", "eos", "fast/strategies/ragged.py",
     "finished = (hit_eos == 1) | (n == remaining)", "finished = n == remaining", RAGGED),
    # ---- budgets
    # (Not listed: commit_counts without its min(., remaining). Every engine clamps a row's proposals
    # to remaining - 1 first, so accepted + 1 <= remaining already; the harness found it equivalent.)
    ("ragged-budget-off-by-one", "budgets", "fast/strategies/ragged.py",
     "remaining = self.budget_end[rows] - content", "remaining = self.budget_end[rows] - content + 1", RAGGED),
    ("ragged-draft-past-budget", "budgets", "fast/proposer.py",
     "clamp = np.minimum(s.k, remaining - 1)\n", "clamp = np.minimum(s.k, remaining)\n",
     RAGGED + PROPOSALS),
    ("eqspec-draft-past-budget", "budgets", "fast/strategies/eqspec.py",
     "clamp = np.minimum(s.k, remaining - 1) if self.draft", "clamp = np.minimum(s.k, remaining) if self.draft",
     ENGINE + PROPOSALS),
    # ---- scheduling
    ("exspec-key-half-length", "scheduling", "fast/strategies/exspec.py",
     "keys = {int(r): (int(c), 1,", "keys = {int(r): (int(c) // 2, 1,", SCHEDULING),
    ("exspec-lone-row-is-a-group", "scheduling", "reference/pool.py",
     "if len(best) >= max(min(2, size), math.ceil(self.min_group_fraction * size)):",
     "if len(best) >= 1:", SCHEDULING),
    ("eqspec-batch-one-too-many", "scheduling", "reference/pool.py",
     "self.running, self.queue = self.queue[:self.batch_size], self.queue[self.batch_size:]",
     "self.running, self.queue = self.queue[:self.batch_size + 1], self.queue[self.batch_size + 1:]", SCHEDULING),
    # ---- sampling
    ("top-k-one-too-few", "sampling", "fast/sampling.py",
     "x = x.masked_fill(x < kth, float(\"-inf\"))", "x = x.masked_fill(x <= kth, float(\"-inf\"))", SAMPLING),
    ("top-p-drops-the-crossing-token", "sampling", "fast/sampling.py",
     "before = probs.cumsum(dim=-1) - probs", "before = probs.cumsum(dim=-1)", SAMPLING),
    ("temperature-multiplies", "sampling", "fast/sampling.py",
     "x = logits.double() / temperature", "x = logits.double() * temperature", SAMPLING),
    # ---- lookup
    ("lookup-across-padding", "lookup", "fast/lookup_draft.py",
     "token = torch.where(visible, history, torch.full_like(history, -1))", "token = history", LOOKUP),
    ("lookup-shortest-ngram-first", "lookup", "fast/lookup_draft.py",
     "for n in range(max_ngram, min_ngram - 1, -1):", "for n in range(min_ngram, max_ngram + 1):", LOOKUP),
    # ---- proposals: the rules (fast.proposals) and the goodput policy (fast.policy)
    ("proposal-depends-on-neighbours", "proposals", "fast/proposals.py",
     "active & (confidence >= self.threshold) & (j + 1 < self.limit)",
     "active & bool((confidence >= self.threshold).any()) & (j + 1 < self.limit)", PROPOSALS),
    ("floor-never-proposes", "proposals", "fast/proposals.py",
     "return active & (confidence >= self.floor), ", "return active & (confidence >= self.threshold), ", PROPOSALS),
    ("floor-always-proposes", "proposals", "fast/proposals.py",
     "return active & (confidence >= self.floor), ", "return active, ", PROPOSALS),
    ("floor-goes-on-drafting", "proposals", "fast/proposals.py",
     "active & (confidence >= self.threshold) & (j + 1 < self.limit)",
     "active & (confidence >= self.floor) & (j + 1 < self.limit)", PROPOSALS),
    ("default-floor-ignored", "proposals", "specbatch/api.py",
     'floor = min(float(opts.draft_floor), threshold)', "floor = threshold", PROPOSALS),
    ("proposal-past-limit", "proposals", "fast/proposals.py",
     "        active = active & (j < self.limit)\n", "        active = active & (j <= self.limit)\n", PROPOSALS),
    ("goodput-step-cost-sign", "proposals", "fast/policy.py",
     "(base + step * steps + token * count)", "(base - step * steps + token * count)", POLICY),
    ("goodput-token-cost-sign", "proposals", "fast/policy.py",
     "(base + step * steps + token * count)", "(base + step * steps - token * count)", POLICY),
    ("goodput-neighbours-calibration", "proposals", "fast/proposals.py",
     "accept = np.minimum(self.calibration * confidence, 1.0)",
     "accept = np.minimum(np.roll(self.calibration, 1) * confidence, 1.0)", POLICY + PROPOSALS),
    ("goodput-neighbours-history", "proposals", "fast/policy.py",
     "own = [self.rows.get((int(r), lookup), History()) for r in requests]",
     "own = [self.rows.get((int(r), lookup), History()) for r in np.roll(requests, 1)]", POLICY),
    ("goodput-step-never-priced", "proposals", "fast/proposals.py",
     "if not self._pays(value * accept, goes_on):", "if False:", POLICY),
    ("goodput-every-row-worth-one", "proposals", "fast/policy.py",
     "return remaining / max(remaining.max(), 1.0)", "return np.ones(rows)", POLICY),
    ("goodput-every-proposal-reached", "proposals", "fast/policy.py",
     "reached = np.minimum(accepted + 1, proposed)", "reached = proposed", POLICY),
    ("goodput-evidence-never-ages", "proposals", "fast/costs.py",
     "    DECAY = 0.9\n\n    def __init__(self):\n        self.reached",
     "    DECAY = 1.0\n\n    def __init__(self):\n        self.reached", POLICY),
    # ---- the engine's lookup in front of a model, a restricted head's logits kept restricted
    ("model-rows-ignore-the-engine-lookup", "lookup", "fast/engine.py",
     "use = torch.as_tensor(lookup_rows, device=found.matched.device) | (found.matched > 0)",
     "use = torch.as_tensor(lookup_rows, device=found.matched.device)", LOOKUP),
    ("subset-argmax-not-mapped-to-tokens", "lookup", "fast/sampling.py",
     "token, confidence = logits.token_ids[logits.values.argmax(dim=-1)], mode_probability(logits.values)",
     "token, confidence = logits.values.argmax(dim=-1), mode_probability(logits.values)", LOOKUP),
    ("engine-lookup-skips-the-history", "lookup", "fast/lookup_draft.py",
     "            store_history(cache, self.model.config.num_hidden_layers, input_ids)\n", "", LOOKUP + FEATURES),
    # ---- drafts that read the target's features
    ("feature-input-off-by-one", "features", "fast/feature_draft.py",
     "before = self.data[rows, (index - 1).clamp(min=0)]", "before = self.data[rows, index.clamp(min=0)]", FEATURES),
    ("feature-draft-keeps-estimate-kv", "features", "fast/feature_draft.py",
     "return n.copy() if model_steps else pending + n", "return np.maximum(n - 1, 1) if model_steps else pending + n",
     FEATURES),
    ("feature-verify-routed-one-index-late", "features", "fast/strategies/ragged.py",
     "self.capture.route(dev(layout.token_row)[None], pos)", "self.capture.route(dev(layout.token_row)[None], pos + 1)",
     FEATURES),
    ("feature-head-drops-residual", "features", "fast/feature_draft.py",
     "predicted = features + self.down(F.silu(x))", "predicted = self.down(F.silu(x))",
     FEATURES + ["tests/test_distilled_draft.py"]),
    ("feature-head-keeps-first-queries", "features", "fast/feature_draft.py",
     "input_ids[:, -int(logits_to_keep):], features[:, -int(logits_to_keep):]",
     "input_ids[:, :int(logits_to_keep)], features[:, :int(logits_to_keep)]", FEATURES),
    # ---- the feature head computes only the rows still drafting by the model
    ("row-subset-scattered-to-first-rows", "features", "fast/feature_draft.py",
     "values = values.new_zeros((batch,) + values.shape[1:]).index_copy_(0, rows, values)",
     "values = values.new_zeros((batch,) + values.shape[1:]).index_copy_(0, torch.arange(len(rows)), values)",
     FEATURES),
    ("row-subset-skips-rows-the-lookup-matched", "features", "fast/engine.py",
     "needed = active & ~lookup_rows",
     "needed = active & ~lookup_rows & ~((found.matched > 0).cpu().numpy() if found is not None else False)",
     LOOKUP + FEATURES),
    # ---- prepacked linears: two rows padded to three on AVX-512 CPUs only
    ("rows-padded-on-every-cpu", "kernels", "fast/kernels.py",
     'return {2: 3} if capability.upper().startswith("AVX512") else {}', "return {2: 3}", KERNELS),
    ("padded-product-keeps-the-wrong-rows", "kernels", "fast/kernels.py",
     "return out[:rows].reshape(*x.shape[:-1], out.shape[-1])",
     "return out[-rows:].reshape(*x.shape[:-1], out.shape[-1])", KERNELS),
    # ---- one options object: every entry point reads the defaults in force
    ("defaults-frozen-at-import", "options", "specbatch/options.py",
     "return dataclasses.replace(DEFAULTS, **COMMAND_DEFAULTS.get(command, {}))",
     "return dataclasses.replace(GenerateOptions(), **COMMAND_DEFAULTS.get(command, {}))", OPTIONS),
    ("cli-ignores-the-command-preset", "options", "specbatch/cli.py",
     "opts = dataclasses.replace(defaults(command), **given)", "opts = dataclasses.replace(defaults(), **given)",
     OPTIONS),
    ("keyword-loses-to-the-options-object", "options", "specbatch/options.py",
     "return dataclasses.replace(base, **overrides), floor_chosen", "return base, floor_chosen", OPTIONS),
    # ---- hostile files: what specbatch writes and reads
    ("writes-follow-symlinks", "files", "specbatch/io.py",
     "flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK",
     "flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK", HOSTILE),
    ("resume-ignores-the-seed", "files", "specbatch/resume.py",
     "if name not in RESUMABLE}", "if name not in RESUMABLE + (\"seed\",)}", HOSTILE),
    ("resume-trusts-any-token-id", "files", "specbatch/resume.py",
     "bad = next((t for t in tokens if not 0 <= t < vocab), None)", "bad = None", HOSTILE),
    ("vectors-checksums-unchecked", "files", "specbatch/conform.py",
     "if checksums.get(name) != file_digest(path / name):", "if name not in checksums:", HOSTILE),
    ("checker-takes-bools-as-ids", "files", "specbatch/testing.py",
     "return isinstance(value, numbers.Integral) and not isinstance(value, bool)",
     "return isinstance(value, numbers.Integral)", HOSTILE),
    ("part-files-truncated", "files", "specbatch/cli.py",
     "writer = ResultWriter(parts[parallel.dp_rank], order, {}, append=True)",
     "writer = ResultWriter(parts[parallel.dp_rank], order, {})",
     HOSTILE + ["tests/test_distributed.py"]),
    ("acceptance-by-position-off-by-one", "stats", "fast/engine.py",
     "self.accepted_at += (np.asarray(accepted)[:, None] >= position).sum(axis=0)",
     "self.accepted_at += (np.asarray(accepted)[:, None] > position).sum(axis=0)", ["tests/test_fast_engine.py"]),
    # ---- device choices (fast.backend) and the fused attention path
    ("fused-attention-drops-the-mask", "device", "fast/attention.py",
     "return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,",
     "return F.scaled_dot_product_attention(query, key, value, attn_mask=None, scale=scaling,", BACKEND),
    ("accelerators-get-the-cpu-choices", "device", "fast/backend.py",
     'return CHOICES["cpu" if torch.device(device).type == "cpu" else "cuda"]', 'return CHOICES["cpu"]', BACKEND),
    ("parts-removed-before-the-merge", "files", "specbatch/cli.py",
     "            ResultWriter(args.out, order, done).finish()  # OUT holds every result before any part goes\n"
     "            for path in every_part:\n                os.remove(path)\n",
     "            for path in every_part:\n                os.remove(path)\n"
     "            ResultWriter(args.out, order, done).finish()\n", ["tests/test_distributed.py"]),
    # ---- the sampled checker (specbatch.sampled): each changes a verdict
    ("pit-not-randomised", "sampled checker", "specbatch/sampled.py",
     "pit = before + rng.random(tokens.shape) * p", "pit = before + p", SAMPLED),
    ("slot-pairs-off-by-one", "sampled checker", "specbatch/sampled.py",
     "pairs = [(rows[g], rows[g + batch_size]) for g in range(len(rows) - batch_size)",
     "pairs = [(rows[g], rows[g + batch_size - 1]) for g in range(len(rows) - batch_size)", SAMPLED),
    ("no-bonferroni", "sampled checker", "specbatch/sampled.py",
     "return self.alpha / max(1, len(self.p_values()))", "return self.alpha", SAMPLED),
    ("rank-bins-off-by-one", "sampled checker", "specbatch/sampled.py",
     "hist = np.bincount(np.minimum((rank * PIT_BINS).astype(int), PIT_BINS - 1), minlength=PIT_BINS)",
     "hist = np.bincount(np.minimum((rank * (PIT_BINS - 1)).astype(int), PIT_BINS - 1), minlength=PIT_BINS)",
     SAMPLED),
    ("slack-narrows-top-k", "sampled checker", "specbatch/sampled.py",
     "x = x.masked_fill(x < kth - slack * (1 + kth.abs()), float(\"-inf\"))",
     "x = x.masked_fill(x < kth + slack * (1 + kth.abs()), float(\"-inf\"))", SAMPLED),
    # ---- tensor parallelism
    ("tp-clock-not-agreed", "tensor parallel", "specbatch/api.py",
     "agree = clock_agreement(target)  # None unless", "agree = None  # None unless", TENSOR_PARALLEL),
    ("tp-group-splits-requests-by-rank", "tensor parallel", "specbatch/distributed.py",
     "mine = shard(len(prompts), group.dp_rank, group.dp_size)", "mine = shard(len(prompts), rank, size)",
     TENSOR_PARALLEL),
    ("tp-every-rank-writes", "tensor parallel", "specbatch/tensor_parallel.py",
     "        return self.tp_rank == 0\n", "        return True\n", TENSOR_PARALLEL),
    # ---- servers (specbatch.serving, conform run) and the greedy checker's tie rule
    ("openai-stop-id-dropped", "servers", "specbatch/serving.py",
     "            tokens.append(int(stop))  # vLLM leaves out", "            pass  # vLLM leaves out", SERVER),
    ("llama-cpp-not-cut-at-eos", "servers", "specbatch/serving.py",
     "            tokens = tokens[:cut + 1]", "            tokens = tokens", SERVER),
    ("prompt-count-unchecked", "servers", "specbatch/serving.py",
     "if isinstance(prompt_tokens, int) and prompt_tokens != len(ask.token_ids):",
     "if isinstance(prompt_tokens, int) and prompt_tokens < 0:", SERVER),
    ("echoed-settings-unchecked", "servers", "specbatch/serving.py",
     "if key in echoed and key in asked and not _same(echoed[key], asked[key]):",
     "if key in echoed and key in asked and not _same(echoed[key], echoed[key]):", SERVER),
    ("server-run-resends-finished", "servers", "specbatch/cli.py",
     "            previous = read_done(out, known_ids=ids)\n", "            previous = {}\n", SERVER),
    ("server-run-overwrites-silently", "servers", "specbatch/cli.py",
     "        elif has_results and not args.overwrite:", "        elif has_results and args.overwrite:", SERVER),
    ("differential-uses-the-ulp-rule", "servers", "specbatch/conform.py",
     "    if reference is not None and tolerance is None:", "    if reference is None and tolerance is None:", SERVER),
    ("tie-gap-to-the-runner-up", "greedy checker", "specbatch/conform.py",
     "    gap = logit[want[j]] - logit.get(got[j], top[-1][1])", "    gap = margin", CONFORM),
    ("tie-tolerance-uncapped", "greedy checker", "specbatch/conform.py",
     "        if value > limit:", "        if value > limit * 1e40:", CONFORM),
    ("top-p-slack-narrows", "sampled checker", "specbatch/sampled.py",
     "outside = outside & (sorted_x < last - slack * (1 + last.abs()))",
     "outside = outside & (sorted_x < last + slack * (1 + last.abs()))", SAMPLED),
]
