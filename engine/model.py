"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias) in plain torch
around the paged-attention kernels, computing over a flattened varlen batch.

It mirrors transformers' Llama numerics op for op (separate projections, fp32 RMSNorm, the same
rotary tables) so greedy tokens match transformers' token for token. The elementwise steps go
through ``kernels`` (fused Triton launches on CUDA that round where transformers rounds; the
op-by-op torch code on CPU).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import kernels


@dataclass
class AttentionMetadata:
    """Kernel inputs for one step; see ``kernels/__init__.py`` for the contract."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # CUDA only: a static ``[num_tokens, num_heads, head_dim]`` buffer the attention writes
    # into (CUDA-graph capture); ``None`` lets the kernel allocate its output.
    attn_out: torch.Tensor | None = None


@dataclass
class _Layer:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    # fused layout (CUDA): q/k/v and gate/up are row views of these
    qkv: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None


class LlamaModel:
    """Weights are the loader's tensors (HF names), used in place: nothing is copied."""

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor],
                 max_positions: int, fuse: bool | None = None,
                 vocab_limit: int | None = None) -> None:
        self.config = config
        # ids at or past ``vocab_limit`` get logit -inf (never sampled): a dummy model that
        # borrows a smaller tokenizer only emits ids that tokenizer can decode
        self.vocab_limit = vocab_limit
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.layers = [self._layer(weights, i) for i in range(config.num_hidden_layers)]
        # CUDA: one GEMM for q/k/v and one for gate/up (fewer, larger kernels per step).
        # CPU keeps transformers' op-for-op numerics.
        fused = self.device.type == "cuda" if fuse is None else fuse
        if fused:
            for i, layer in enumerate(self.layers):
                self._fuse(weights, i, layer)
        rotary = LlamaRotaryEmbedding(config).to(self.device)
        positions = torch.arange(max_positions, device=self.device)[None, :]
        cos, sin = rotary(self.embed[:1], positions)
        self.cos, self.sin = cos[0], sin[0]
        # the norm after each layer's MLP: the next layer's input norm, then the final norm
        self.next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> _Layer:
        p = f"model.layers.{i}."
        return _Layer(
            input_norm=w[p + "input_layernorm.weight"],
            q=w[p + "self_attn.q_proj.weight"], k=w[p + "self_attn.k_proj.weight"],
            v=w[p + "self_attn.v_proj.weight"],
            q_bias=w.get(p + "self_attn.q_proj.bias"), k_bias=w.get(p + "self_attn.k_proj.bias"),
            v_bias=w.get(p + "self_attn.v_proj.bias"),
            o=w[p + "self_attn.o_proj.weight"],
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate=w[p + "mlp.gate_proj.weight"], up=w[p + "mlp.up_proj.weight"],
            down=w[p + "mlp.down_proj.weight"],
        )

    @staticmethod
    def _fuse(w: dict[str, torch.Tensor], i: int, layer: _Layer) -> None:
        """Concatenate q/k/v (and biases) and gate/up, then point the layer *and* the weights
        dict at row views of the fused tensors, so the originals are freed (no extra memory)
        and anything built later from the dict (e.g. ``build_hf_model``) shares them."""
        p = f"model.layers.{i}."
        nq, nk = layer.q.shape[0], layer.k.shape[0]
        layer.qkv = torch.cat([layer.q, layer.k, layer.v])
        layer.q, layer.k, layer.v = layer.qkv[:nq], layer.qkv[nq:nq + nk], layer.qkv[nq + nk:]
        for name, view in (("q", layer.q), ("k", layer.k), ("v", layer.v)):
            w[f"{p}self_attn.{name}_proj.weight"] = view
        if layer.q_bias is not None:
            layer.qkv_bias = torch.cat([layer.q_bias, layer.k_bias, layer.v_bias])
            b = layer.qkv_bias
            layer.q_bias, layer.k_bias, layer.v_bias = b[:nq], b[nq:nq + nk], b[nq + nk:]
            for name, view in (("q", layer.q_bias), ("k", layer.k_bias), ("v", layer.v_bias)):
                w[f"{p}self_attn.{name}_proj.bias"] = view
        ni = layer.gate.shape[0]
        layer.gate_up = torch.cat([layer.gate, layer.up])
        layer.gate, layer.up = layer.gate_up[:ni], layer.gate_up[ni:]
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = layer.gate, layer.up

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm; writes this step's K/V
        into ``kv_cache [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]``."""
        n = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        x = kernels.rms_norm(h, self.layers[0].input_norm, self.eps)
        cos, sin = self.cos[positions], self.sin[positions]
        for index, (layer, next_norm) in enumerate(zip(self.layers, self.next_norms,
                                                       strict=True)):
            q, k, v = self._qkv(layer, x)
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            v = v.view(n, self.num_kv_heads, self.head_dim)
            key_cache, value_cache = kv_cache[0, index], kv_cache[1, index]
            kernels.rotary_and_cache(q, k, v, cos, sin, key_cache, value_cache,
                                     meta.slot_mapping)
            o = kernels.paged_attention(
                q, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, self.scale, meta.max_query_len, meta.max_seq_len,
                out=meta.attn_out,
            )
            x = kernels.add_rms_norm(F.linear(o.reshape(n, -1), layer.o), h, layer.post_norm,
                                     self.eps)
            x = kernels.add_rms_norm(F.linear(self._gated(layer, x), layer.down), h, next_norm,
                                     self.eps)
        return x

    @staticmethod
    def _qkv(layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if layer.qkv is not None:
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            return qkv.split([layer.q.shape[0], layer.k.shape[0], layer.v.shape[0]], dim=-1)
        return (F.linear(x, layer.q, layer.q_bias), F.linear(x, layer.k, layer.k_bias),
                F.linear(x, layer.v, layer.v_bias))

    @staticmethod
    def _gated(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate(x)) * up(x)``."""
        if layer.gate_up is not None:
            return kernels.silu_and_mul(F.linear(x, layer.gate_up))
        return F.silu(F.linear(x, layer.gate)) * F.linear(x, layer.up)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, as transformers computes them; the sampler upcasts
        only where it needs float32 (softmax, logprobs): a greedy row is its argmax."""
        logits = F.linear(hidden, self.lm_head)
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits[:, self.vocab_limit:] = float("-inf")
        return logits
