"""A lean forward for small Llama-architecture drafts.

A step of the distilled draft (2 layers, hidden size 256) at batch 1 took 2.2 ms on this CPU with
its weights in cache and 3.7 ms after a target forward had streamed through memory, of which the
15 small linear products took 0.9 ms: the rest is transformers' module machinery around about a
hundred small tensor operations. This module computes the same function with less of it:
- the q/k/v projections and the gate/up projections each fused into one product (7 products a
  layer become 4),
- the rotary angles computed once per forward by the model's own rotary module and applied to the
  query and key heads together (`rotary_angles`), with the arithmetic of transformers'
  apply_rotary_pos_emb,
- RMS norms, the rotation and the SiLU product by torch's operators (`TorchOps`), or where the
  engine runs native (fast.compute.native.element_ops) by one C++ kernel each,
- the linear layers called through their forward, without nn.Module's call machinery: hooks on the
  model's o_proj and down_proj do not run in the lean forward (those on its q/k/v, gate and up
  projections never could: the fused copies compute them),
- attention by fast.compute.attention.specbatch_attention, the engine's own: the mask the engine passes
  decides what each query sees (I4) and the engine's row plan applies, exactly as in the model,
- the cache updated through `Cache.update`, so every layout's cache works (DynamicCache in the
  rectangular layouts, SlotCache in the ragged one).

Its logits equal the model's up to floating-point rounding (tests/test_lean_llama.py). A draft's
numerics can change which tokens it proposes, never the output: every proposal is verified by the
target (proofs_notes/equivalence.md).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .attention import specbatch_attention
from .backend import sharded
from .native import element_ops
from .native import flat_blocks as native_blocks


def supported(model) -> bool:
    """Whether `model` is a Llama causal LM this module computes exactly (up to rounding)."""
    config = getattr(model, "config", None)
    rope = getattr(config, "rope_parameters", None) or {}
    return getattr(config, "model_type", None) == "llama" and rope.get("rope_type", "default") == "default" \
        and getattr(config, "hidden_act", None) == "silu" and not getattr(config, "attention_bias", False) \
        and not getattr(config, "mlp_bias", False) and getattr(config, "pretraining_tp", 1) == 1 \
        and hasattr(getattr(model, "model", None), "layers") and not sharded(model)


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Linear:
    """An nn.Linear holding copies of `weight` [out, in] (and `bias`), on their device and dtype."""
    linear = torch.nn.utils.skip_init(torch.nn.Linear, weight.shape[1], weight.shape[0], bias=bias is not None,
                                      device=weight.device, dtype=weight.dtype)  # no random init: copied below
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def fused_linear(*layers: torch.nn.Linear) -> torch.nn.Linear:
    """One nn.Linear whose output is the given layers' outputs side by side (no bias)."""
    return linear_from(torch.cat([layer.weight.detach() for layer in layers]))


def rotary_angles(rotary, hidden, position_ids):
    """(cos, signed_sin), each [B, Q, 1, D], for `rotate`: the rotary module's angles, with the sign of
    rotate_half folded into the sine once per forward instead of once per layer."""
    cos, sin = rotary(hidden, position_ids)  # [B, Q, D]
    half = sin.shape[-1] // 2
    return cos[:, :, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, :, None]


def rotate(x, cos, signed_sin):
    """transformers' x * cos + rotate_half(x) * sin, bitwise: rotate_half(x) = cat(-x2, x1) and
    x.roll(half) = cat(x2, x1) differ only in the sign of the first half, which signed_sin carries
    (negation is exact, so (-a) * b == a * (-b)). x [B, Q, heads, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class TorchOps:
    """A block's element-wise steps by torch's operators. fast.compute.native's extension has the same
    three, each one kernel (element_ops); a forward uses one or the other for all its blocks."""

    @staticmethod
    def rms_norm(x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    rotate = staticmethod(rotate)

    @staticmethod
    def silu_mul(gate_up):
        """silu(gate) * up of a fused gate/up product [.., 2 I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


TORCH_OPS = TorchOps()


class LeanBlock(torch.nn.Module):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU MLP, each with its residual."""

    def __init__(self, layer, config):
        super().__init__()
        attention, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.qkv = fused_linear(attention.q_proj, attention.k_proj, attention.v_proj)
        self.o = attention.o_proj
        self.gate_up = fused_linear(mlp.gate_proj, mlp.up_proj)
        self.down = mlp.down_proj
        self.attention_norm, self.mlp_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight

    def forward(self, hidden, cos, signed_sin, mask, cache, index: int, ops=TORCH_OPS):
        """cos, signed_sin: rotary_angles of the forward's positions. ops: the element-wise steps'
        kernels (TORCH_OPS, or fast.compute.native.element_ops)."""
        batch, queries, _ = hidden.shape
        x = ops.rms_norm(hidden, self.attention_norm, self.eps)
        qkv = self.qkv.forward(x).view(batch, queries, -1, self.head_dim)  # [B, Q, H + 2 Hkv, D]
        rotated = self.heads + self.kv_heads
        qk = ops.rotate(qkv[:, :, :rotated], cos, signed_sin)  # q's and k's heads: one rotation, every head alike
        q, k = qk[:, :, :self.heads].transpose(1, 2), qk[:, :, self.heads:].transpose(1, 2)
        v = qkv[:, :, rotated:].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, index)
        out, _ = specbatch_attention(self, q, k, v, mask, scaling=self.scaling)  # [B, Q, H, D]
        hidden = hidden + self.o.forward(out.reshape(batch, queries, -1))
        x = ops.rms_norm(hidden, self.mlp_norm, self.eps)
        return hidden + self.down.forward(ops.silu_mul(self.gate_up.forward(x)))


class LeanLlama(torch.nn.Module):
    """The decoder of a Llama causal LM (`supported(model)`): input ids, position ids, a 4D additive
    mask and a cache in, the final hidden states out (the caller applies its head). The embedding,
    rotary module, output projections, norms and down projections are the model's own; the fused
    projections are copies made here."""

    def __init__(self, model):
        super().__init__()
        base, config = model.model, model.config
        self.embed = base.embed_tokens
        self.blocks = torch.nn.ModuleList(LeanBlock(layer, config) for layer in base.layers)
        self.norm, self.eps = base.norm.weight, config.rms_norm_eps
        self.rotary = base.rotary_emb

    def forward(self, input_ids, position_ids, attention_mask, cache, added=None, final_norm=True, native=False):
        """added: [B, Q, hidden] added to the token embeddings (fast.drafts.reduced_head's feature input).
        final_norm=False: the last block's output, before the model's final norm. native: run the
        blocks of a flat forward in one C++ call where it can, and the others with its element-wise
        kernels (fast.compute.native: the two loops compute bitwise the same)."""
        hidden = self.embed(input_ids) if added is None else self.embed(input_ids) + added
        cos, signed_sin = rotary_angles(self.rotary, hidden, position_ids)
        blocks_out = native_blocks(self, hidden, cos, signed_sin, cache) if native else None
        if blocks_out is not None:
            hidden = blocks_out
        else:
            ops = (element_ops(hidden) if native else None) or TORCH_OPS
            for index, block in enumerate(self.blocks):
                hidden = block.forward(hidden, cos, signed_sin, attention_mask, cache, index, ops)
        return F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.eps) if final_norm else hidden


_MADE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (weights key, LeanCausalLM)


class LeanOutput:
    def __init__(self, logits):
        self.logits = logits


class LeanCausalLM(torch.nn.Module):
    """A Llama causal LM (`supported(model)`) as the engine's target runs it: LeanLlama's blocks, then
    the model's own final norm module (so that hooks on it run: fast.drafts.feature_draft reads the target's
    features there) and its own head. Called like the model by fast.models.ModelRunner."""

    def __init__(self, model):
        super().__init__()
        self.decoder = LeanLlama(model)
        self.final_norm, self.head = model.model.norm, model.get_output_embeddings()
        self.replaced = self._copied(model)  # computed by the fused copies instead

    @classmethod
    def of(cls, model) -> "LeanCausalLM":
        """The LeanCausalLM of `model`, made once and kept beside it (not in it) while the weights it
        copied are unchanged (their storage and version), so that a run pays nothing to build it."""
        key = tuple((m.weight.data_ptr(), m.weight._version) for m in cls._copied(model))
        kept = _MADE.get(model)
        if kept is None or kept[0] != key:
            kept = (key, cls(model))
            _MADE[model] = kept
        return kept[1]

    @staticmethod
    def _copied(model) -> list:
        return [m for block in model.model.layers for m in (block.self_attn.q_proj, block.self_attn.k_proj,
                block.self_attn.v_proj, block.mlp.gate_proj, block.mlp.up_proj)]

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, use_cache=True,
                logits_to_keep=0, native=False):
        hidden = self.final_norm(self.decoder(input_ids, position_ids, attention_mask, cache, final_norm=False,
                                              native=native))
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return LeanOutput(self.head(hidden))
