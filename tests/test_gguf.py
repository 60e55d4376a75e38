"""A GGUF file written with the `gguf` package from a tiny random Llama (weights in llama.cpp's
layout, a byte-level BPE vocabulary) loads through specbatch's loader into the same model: same
logits, same greedy tokens, and a tokenizer with the written vocabulary. No network."""
import numpy as np
import pytest
import torch

from hf_models import VOCAB, tiny
from specbatch.fast.loading import ModelLoadError, load_model

gguf = pytest.importorskip("gguf")

# a byte-level BPE vocabulary: 36 characters and 60 merges of two characters
_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789")
_PAIRS = [(x, y) for x in "abcdefghij" for y in "klmnop"]
TOKENS = _CHARS + [x + y for x, y in _PAIRS]
MERGES = [f"{x} {y}" for x, y in _PAIRS]
assert len(TOKENS) == VOCAB


def to_llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp orders each head's rotary rows as interleaved pairs; transformers as two halves."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model, path):
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test-llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf, cpp in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{cpp}.weight"
    for hf_name, cpp_name in names.items():
        weight = state[hf_name]
        if cpp_name.endswith("attn_q.weight"):
            weight = to_llama_cpp_rows(weight, c.num_attention_heads)
        elif cpp_name.endswith("attn_k.weight"):
            weight = to_llama_cpp_rows(weight, c.num_key_value_heads)
        writer.add_tensor(cpp_name, np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_written_gguf_loads_as_the_same_model(tmp_path):
    source = tiny("llama", layers=2, seed=11, dtype=torch.float32, tie_word_embeddings=False)
    path = tmp_path / "tiny.gguf"
    write_gguf(source, path)
    model, tokenizer = load_model(str(path), "float32")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 2, 41]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=1e-5, atol=1e-5)
        want = source.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert got.tolist() == want.tolist()
    assert tokenizer.convert_ids_to_tokens([0, 36, 95]) == ["a", "ak", "jp"]
    assert tokenizer("akz9", add_special_tokens=False)["input_ids"] == [36, 25, 35]  # the merge "a k" applies


def test_a_missing_or_corrupt_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_model(str(tmp_path / "absent.gguf"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(str(broken))
