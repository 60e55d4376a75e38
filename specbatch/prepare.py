"""From names and files to the inputs of `specbatch.generate`: the model pair and the encoded
prompts. Shared by the CLI, the bench, the benchmarks and the training scripts; every function
takes explicit arguments. Problems come back as UserError (one line, exit 2 in the CLI)."""
from __future__ import annotations

from .errors import UserError
from .options import defaults


def load(target: str, draft: str | None = None, *, dtype: str | None = None, device: str | None = None):
    """(target, draft or None, tokenizer) by name: a Hugging Face folder, a .gguf file, a hub id or
    "smollm2" for the target; for the draft also "smollm2-draft", "smollm2-head", "lookup",
    "truncated:N", "none" and any of them + "+lookup" (docs/drafts.md). dtype and device default to
    `GenerateOptions`' (float32, cpu). Errors are UserError naming the model and the problem."""
    from transformers.utils import logging as hf_logging

    from .fast.loading import ModelLoadError, load_draft, load_model
    from .fast.models import check_pair
    dtype = dtype or defaults().dtype
    device = device or defaults().device
    hf_logging.disable_progress_bar()  # our own bars only: errors stay one line
    try:
        target_model, tokenizer = load_model(target, dtype, device)
        draft_model, draft_tokenizer = load_draft(draft, target_model, dtype, device)
        check_pair(target_model, draft_model, tokenizer, draft_tokenizer)
    except (ModelLoadError, ValueError) as e:
        raise UserError(str(e)) from None
    return target_model, draft_model, tokenizer


def encode_prompts(texts, tokenizer, chat_template: bool) -> list[list[int]]:
    """Token ids of text prompts: each one user turn of the chat template with --chat-template, else as it is."""
    from .api import encode_text
    if tokenizer is None:
        raise UserError("the target has no tokenizer: text prompts cannot be encoded")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise UserError("--chat-template: the target's tokenizer has no chat template; drop the option")
    return [encode_text(text, tokenizer, chat_template) for text in texts]


def run_generate(target, draft, ids, options, **extra):
    """specbatch.generate with `options` (a GenerateOptions), its ValueErrors as UserError."""
    import specbatch
    try:
        return specbatch.generate(target, draft, ids, options, **extra)
    except ValueError as e:
        raise UserError(str(e)) from None


def read_prompt_file(path):
    from .io import InputError, read_prompts
    try:
        return read_prompts(path)
    except InputError as e:
        raise UserError(str(e)) from None
