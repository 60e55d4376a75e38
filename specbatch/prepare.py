"""From files and arguments to the inputs of `specbatch.generate`: the model pair, the encoded
prompts and the options. Shared by the CLI, the bench, the benchmarks and the training scripts;
problems come back as UserError (one line, exit 2 in the CLI)."""
from __future__ import annotations

from .errors import UserError


def load_pair(args):
    """(target, draft or None, tokenizer) as the arguments say, with errors as UserError."""
    from transformers.utils import logging as hf_logging

    from .fast.loading import ModelLoadError, load_draft, load_model
    from .fast.models import check_pair
    hf_logging.disable_progress_bar()  # our own bars only: errors stay one line
    try:
        target, tokenizer = load_model(args.target, args.dtype, args.device)
        draft, draft_tokenizer = load_draft(args.draft, target, args.dtype, args.device)
        check_pair(target, draft, tokenizer, draft_tokenizer)
    except (ModelLoadError, ValueError) as e:
        raise UserError(str(e)) from None
    return target, draft, tokenizer


def encode_prompts(texts, tokenizer, chat_template: bool) -> list[list[int]]:
    if tokenizer is None:
        raise UserError("the target has no tokenizer: text prompts cannot be encoded")
    out = []
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise UserError("--chat-template: the target's tokenizer has no chat template; drop the option")
    for text in texts:
        if chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(list(ids))
    return out


def sampling_kwargs(args) -> dict:
    kw = {}
    if args.temperature:
        kw.update(temperature=args.temperature, seed=args.seed, sampling=args.sampling)
        if args.top_k is not None:
            kw["top_k"] = args.top_k
        if args.top_p is not None:
            kw["top_p"] = args.top_p
    return kw


def engine_options(args) -> dict:
    """Options of the forward path, the same for a method and its target-only baseline."""
    return dict(prepack=not getattr(args, "no_prepack", False), compile=getattr(args, "compile", False))


def proposal_options(args) -> dict:
    """How far rows draft: --draft-threshold (default 0.7), --draft-floor (default 0.2) and --fixed-k
    (no threshold, no controller)."""
    if getattr(args, "fixed_k", False):
        return dict(draft_threshold=0.0, adaptive=False)
    given = dict(draft_threshold=getattr(args, "draft_threshold", None), draft_floor=getattr(args, "draft_floor", None))
    return {name: value for name, value in given.items() if value is not None}


def run_generate(target, draft, ids, args, **extra):
    import specbatch
    try:
        return specbatch.generate(target, draft, ids, max_new_tokens=args.max_new_tokens,
                                  num_draft_tokens=args.num_draft_tokens, batch_size=args.batch_size,
                                  strategy=args.strategy, **sampling_kwargs(args), **engine_options(args),
                                  **proposal_options(args), **extra)
    except ValueError as e:
        raise UserError(str(e)) from None


def read_prompt_file(path):
    from .io import InputError, read_prompts
    try:
        return read_prompts(path)
    except InputError as e:
        raise UserError(str(e)) from None
