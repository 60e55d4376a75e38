"""Hugging Face causal LMs as specbatch uses them: checks on a (target, draft) pair, the forward
call with explicit positions and a 4D mask, EOS ids, context limits and attention windows."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace

import torch


def cache_argument(model) -> str:
    """The forward's cache keyword: `cache` in transformers >= 5.x, `past_key_values` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass(frozen=True)
class DraftAbilities:
    """What a draft declares it can do, read once (`abilities_of`): the engine consults this, never
    a draft's class. A draft declares an ability as an attribute of the same name; absent is no."""

    reads_features: bool = False  # reads the target's features of its content (fast.drafts.feature_draft): ragged only
    returns_subset: bool = False  # forward(subset_logits=True) returns logits over its own token subset
    computes_row_subset: bool = False  # forward(rows=...) computes only those rows (rows independent, no K/V)
    prompt_lookup: object = None  # a lookup-first draft's own lookup (min_match, max_ngram) that the engine
    #                               may run itself for rows that draft by lookup, with forward(engine_lookup=True)
    ranks_candidates: bool = True  # its logits rank tokens beyond its proposal (token trees' leaves, fast.trees)


def abilities_of(model) -> DraftAbilities:
    """The abilities `model` declares (none for a plain Hugging Face model)."""
    return DraftAbilities(**{name: getattr(model, name, default) for name, default in
                             (("reads_features", False), ("returns_subset", False), ("computes_row_subset", False),
                              ("prompt_lookup", None), ("ranks_candidates", True))})


class ModelRunner:
    """Calls one model with input ids, explicit position ids, a 4D additive mask and a cache.

    Counts the token positions it processes (the work counters in the stats). kv_lens, when given,
    is each row's visible length (host integers): fast.compute.attention then reads each group of rows of
    similar length only up to its own longest row."""

    def __init__(self, model, lean: bool = False, native: bool = False):
        """lean: run a Llama model (fast.compute.lean_llama.supported) through LeanCausalLM, the same function
        with fused projections and fewer operations per layer; other models run as they are. native:
        LeanCausalLM runs the blocks of a flat forward in one C++ call (fast.compute.native)."""
        from .compute.lean_llama import LeanCausalLM, supported
        self.model = model
        self.lean = LeanCausalLM.of(model) if lean and supported(model) else None
        self.native = native and self.lean is not None
        self.cache_kw = "cache" if self.lean is not None else cache_argument(model)
        self.tokens_processed = 0
        self.last_features = None
        self.abilities = abilities_of(model)

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def __call__(self, input_ids, position_ids, mask, cache, last_only: bool = False, kv_lens=None, flat=None,
                 features=None, segments=None, **options):
        """flat: the FlatParts of a flat forward (fast.compute.attention.flat_plan), whose attention they define.
        segments: a packed prefill's prompts (start, end), where its mask is causal within each and
        hides every other prompt (fast.compute.attention.segment_attention).
        features: the target's features for a draft that reads them (fast.drafts.feature_draft); the draft's
        own estimates of every query's feature are then kept in `last_features`. options: further
        keyword arguments of the model's forward (a draft's subset_logits, engine_lookup)."""
        from .compute.attention import forward_plan
        self.tokens_processed += input_ids.numel()
        kwargs = {self.cache_kw: cache, **options}
        if last_only:
            kwargs["logits_to_keep"] = 1
        if features is not None:
            kwargs["features"] = features
        if self.native:
            kwargs["native"] = True
        with torch.inference_mode(), forward_plan(kv_lens, input_ids.device, flat, segments):
            out = (self.lean or self.model)(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                            use_cache=True, **kwargs)
        self.last_features = getattr(out, "features", None)
        return out.logits


def vocab_size(model) -> int:
    """Number of logits the model produces (its output embedding rows, else config.vocab_size)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def context_limit(model) -> int | None:
    """Longest sequence the model's position encoding supports, where the config says."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def attention_window(model) -> tuple[int | None, bool]:
    """(window, uniform): the sliding attention window, and whether every layer uses it.

    specbatch applies a uniform window by position in its own mask (I4); a model that mixes full
    and sliding layers is refused when sequences outgrow the window."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return None, True
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return window, True
    sliding = [t == "sliding_attention" for t in layer_types]
    if not any(sliding):
        return None, True
    return window, all(sliding)


def eos_ids_of(model, eos_token_id=None) -> tuple[int, ...]:
    """EOS ids: the argument (int or list), else every id in target.generation_config/config."""
    if eos_token_id is None:
        for source in (getattr(model, "generation_config", None), model.config):
            eos_token_id = getattr(source, "eos_token_id", None) if source is not None else None
            if eos_token_id is not None:
                break
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, int):
        return (eos_token_id,)
    return tuple(int(e) for e in eos_token_id)


def mask_fill_value(dtype: torch.dtype) -> float:
    """The additive score for a hidden slot: very negative but finite, so a fully masked pad query
    stays finite (no NaN reaches visible slots) and float64 eager attention, whose softmax runs in
    float32, does not overflow."""
    base = torch.float32 if dtype in (torch.float32, torch.float64) else dtype
    return torch.finfo(base).min / 2


def check_pair(target, draft, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Refuse a (target, draft) pair that cannot be verified token by token, naming the problem."""
    for name, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        if "position_ids" not in inspect.signature(model.forward).parameters:
            raise ValueError(f"{name} model {type(model).__name__} does not accept position_ids; specbatch needs "
                             "explicit positions for padded and ragged batches")
    if draft is None:
        return
    if vocab_size(target) != vocab_size(draft):
        raise ValueError(f"target and draft vocabularies differ: target has {vocab_size(target)} output tokens, "
                         f"draft has {vocab_size(draft)}")
    if target.device != draft.device:
        raise ValueError(f"target is on {target.device} but draft is on {draft.device}; put both on one device")
    weights = [next(iter(m.parameters()), None) for m in (target, draft)]  # lookup drafts have none
    dtypes = [w.dtype if w is not None else None for w in weights]
    if None not in dtypes and dtypes[0] != dtypes[1]:
        raise ValueError(f"target is {str(dtypes[0]).removeprefix('torch.')} but draft is "
                         f"{str(dtypes[1]).removeprefix('torch.')}; load both in one dtype")
    if target_tokenizer is not None and draft_tokenizer is not None \
            and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError("target and draft tokenizers have different vocabularies")


class WeightlessLM(torch.nn.Module):
    """The shell of a causal LM without weights (prompt lookup, imposed distributions in tests):
    a one-layer config of the given vocabulary, a device taken from its first buffer, no output
    embedding. Subclasses register a buffer and implement forward(input_ids, position_ids,
    attention_mask, cache, logits_to_keep)."""

    def __init__(self, vocab_size: int, model_type: str, generation_config=None):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, num_hidden_layers=1, sliding_window=None,
                                      max_position_embeddings=None, model_type=model_type)
        self.generation_config = generation_config

    @property
    def device(self):
        return next(self.buffers()).device

    def get_output_embeddings(self):
        return None
