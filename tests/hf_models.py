"""Tiny random-initialised Hugging Face causal LMs of several architectures, and the oracle.

Models are made on the test device (`pytest --device`, or $SPECBATCH_TEST_DEVICE; default cpu)."""
import functools
import os

import torch
import transformers as tf

VOCAB = 96
EOS = 7

ARCHS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                                         num_key_value_heads=2)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                                        num_key_value_heads=2, head_dim=8)),
    "glm4": (tf.Glm4Config, tf.Glm4ForCausalLM, dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                                     num_key_value_heads=2, head_dim=8)),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, dict(n_embd=32, n_head=4, n_positions=512)),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, dict(hidden_size=32, intermediate_size=64,
                                                               num_attention_heads=4)),
    "opt": (tf.OPTConfig, tf.OPTForCausalLM, dict(hidden_size=32, ffn_dim=64, num_attention_heads=4,
                                                  word_embed_proj_dim=32)),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(hidden_size=32, intermediate_size=64,
                                                              num_attention_heads=4, num_key_value_heads=2,
                                                              sliding_window=512)),
    # Gemma 2: attention and final logits soft-capped (tanh), strong enough to change greedy output;
    # untied embeddings (tied ones make a random Gemma repeat its last token whatever the attention);
    # eager attention for the oracle: transformers 5.17 defaults Gemma 2 to SDPA, which skips the
    # attention soft-capping (found on the H100 check; transformers 5.25 refuses SDPA for Gemma 2)
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                                          num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                                                          attn_logit_softcapping=0.8, final_logit_softcapping=2.0,
                                                          sliding_window=512, initializer_range=0.3,
                                                          tie_word_embeddings=False, attn_implementation="eager")),
}


def device_under_test() -> str:
    """The device the tests run the engine on (tests/conftest.py sets it from --device)."""
    return os.environ.get("SPECBATCH_TEST_DEVICE", "cpu")


def tiny(arch="llama", layers=2, seed=0, dtype=torch.float64, **overrides):
    """A tiny model of `arch` on the test device, the same object for the same arguments."""
    return _tiny(arch, layers, seed, dtype, device_under_test(), **overrides)


@functools.lru_cache(maxsize=None)
def _tiny(arch, layers, seed, dtype, device, **overrides):
    config_cls, model_cls, kw = ARCHS[arch]
    layer_key = "n_layer" if arch == "gpt2" else "num_hidden_layers"
    overrides = {key: list(v) if isinstance(v, tuple) else v for key, v in overrides.items()}
    kw = {**kw, layer_key: layers, "vocab_size": VOCAB, "eos_token_id": EOS, "pad_token_id": EOS,
          "bos_token_id": 1, **overrides}
    if arch != "gpt2":
        kw.setdefault("max_position_embeddings", 512)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).to(dtype).eval().to(device)  # initialised on the CPU: the same weights
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = EOS
    return model


def hf_greedy(model, prompt, max_new_tokens, eos_ids):
    """transformers' own greedy decoding at batch 1, no padding, cut after the first EOS."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=0,
                             do_sample=False, eos_token_id=list(eos_ids) or None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    for j, t in enumerate(new):
        if t in eos_ids:
            return new[:j + 1]
    return new


def assert_ties_only(target, prompts, strategy):
    """Speculative decoding (a scripted draft, every row drafting 3 tokens) equals target-only
    decoding of the same model in its own dtype, except at floating-point ties (fast.equivalence),
    at all but two prompts at most: the half-precision check."""
    import specbatch
    from specbatch.fast.drafts.scripted import ScriptedDraft
    from specbatch.fast.equivalence import compare
    from specbatch.reference import deviate_hashed
    reference = specbatch.generate(target, None, prompts, max_new_tokens=10, batch_size=1, strategy="ragged")
    result = specbatch.generate(target, ScriptedDraft(target, deviate_hashed(4, 0.3)), prompts, max_new_tokens=10,
                                num_draft_tokens=3, batch_size=4, strategy=strategy, eos_token_id=[EOS], **FIXED_K)
    reports = compare(target, prompts, result.sequences, reference.sequences)
    assert [r for r in reports if not r["exact"] and r["kind"] == "error"] == []
    assert sum(r["exact"] for r in reports) >= len(prompts) - 2


def oracle(model, prompts, max_new_tokens, eos_ids):
    budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    return [hf_greedy(model, p, m, tuple(eos_ids)) for p, m in zip(prompts, budgets)]


# Speculative decoding with every row drafting its whole limit every round (no confidence threshold,
# no cost-priced policy): what tests of the drafting, verifying and cache machinery need to exercise it.
FIXED_K = dict(policy="fixed")


# ---------------------------------------------------------------- model folders for the CLI

WORDS = [f"w{i}" for i in range(VOCAB)]
WORDS[0], WORDS[1], WORDS[EOS] = "<unk>", "<s>", "</s>"
CHAT = "{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}{% if add_generation_prompt %} <s>{% endif %}"


def word_tokenizer():
    """The tiny models' tokenizer: token i is the word w{i} (0, 1 and EOS are <unk>, <s>, </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="</s>")
    tok.chat_template = CHAT
    return tok


def save_folder(path, model):
    tok = word_tokenizer()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


PROMPTS = ["w10 w11 w12 w13", "w20", "w30 w31 w32 w33 w34 w35 w36 w37 w38 w39 w40 w41 w42 w43 w44 w45",
           "w50 </s> w52", "w60 w61"]
