"""Gemma 3 text models: the Llama block with a norm after attention and after the MLP.

The rest of what sets Gemma 3 apart is configuration the shared layers read
(pyllm.model.registry): embeddings scaled by sqrt(hidden_size), RMSNorm weights of
(1 + w), per-head q/k RMSNorm, GELU-gated MLP, softmax scale from
query_pre_attn_scalar, and sliding-window layers with their own rope base between the
global ones.
"""

from __future__ import annotations

from pyllm.model.config import ModelConfig
from pyllm.model.layers import MLP, Attention, RMSNorm
from pyllm.model.llama import LlamaForCausalLM, input_norm
from pyllm.model.module import Module


class Gemma3DecoderLayer(Module):
    def __init__(self, config: ModelConfig, dtype, device, layer: int) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, dtype, device)
        self.self_attn = Attention(config, dtype, device, config.layer_window(layer))
        self.post_attention_layernorm = RMSNorm(size, eps, dtype, device)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, dtype, device)
        self.mlp = MLP(config, dtype, device)
        self.post_feedforward_layernorm = RMSNorm(size, eps, dtype, device)

    def forward(self, positions, hidden, residual, cos_sin_cache, kv_cache, meta, step):
        """As the Llama layer, `residual` carries the stream and the pre-norms fuse the
        residual add; the post-norms act on each block's output before it is added."""
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin_cache, kv_cache, meta, step)
        hidden = self.post_attention_layernorm(hidden)
        hidden = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.post_feedforward_layernorm(self.mlp(hidden, step))
        return hidden, residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer
