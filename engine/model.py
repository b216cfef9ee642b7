"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias) in plain torch
around the paged-attention kernels, computing over a flattened varlen batch.

It mirrors transformers' Llama numerics op for op (separate projections, fp32 RMSNorm, the same
rotary tables) so greedy tokens match transformers' token for token. Attention and the
elementwise steps go through the kernel backend chosen when the model is built
(``chatgate_kernels.model_kernels``: fused Triton launches on CUDA that round where
transformers rounds; on CPU the fused C++ rotary, bit-identical, and transformers' op-by-op
torch code for the rest). Quantized on the CPU with the fused CPU kernels, the model is
``engine.quantized_cpu_model.QuantizedCpuModel``; FP8 on the GPU changes only the four products
of each layer (``engine/quantization.py``).
"""

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from chatgate_kernels import ReferenceKernels, model_kernels
from chatgate_kernels.reference import AttentionPlan
from engine.quantization import (
    CPU_QUANTIZATIONS,
    Int8Linear,
    QuantizedLinear,
    check_quantization,
    quantized_linear,
    resolve_quantization,
)
from engine.tensor_parallel import TensorParallel

logger = logging.getLogger("engine.model")


@dataclass
class AttentionMetadata:
    """Kernel inputs for one step; see ``chatgate_kernels/__init__.py`` for the contract."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # CUDA only: a static ``[num_tokens, num_heads, head_dim]`` buffer the attention writes
    # into (CUDA-graph capture); ``None`` lets the kernel allocate its output.
    attn_out: torch.Tensor | None = None
    # the torch reference only: the step's index work for every layer's attention (the
    # backend's ``attention_plan``)
    plan: AttentionPlan | None = None
    # Triton only: the order the decode kernel starts the rows in, longest context first
    # (the backend's ``decode_row_order``)
    row_order: torch.Tensor | None = None
    # Triton only, steps with a query of several tokens: the extend kernel's tile map (the
    # backend's ``extend_tiles``)
    extend_tiles: torch.Tensor | None = None


Weight = torch.Tensor | QuantizedLinear


@dataclass
class _Layer:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: Weight
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: Weight
    # fused layout (CUDA, and quantized CPU): q/k/v and gate/up are row views of these, or
    # (quantized) what computes them
    qkv: Weight | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up: Weight | None = None


def _linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        return weight(x)
    return F.linear(x, weight, bias)


class LlamaModel:
    """Weights are the loader's tensors (HF names), used in place: nothing is copied. With
    ``tp``, they are this rank's shard (``engine.tensor_parallel.Shard``) and the head
    counts are this rank's. ``kv_cache_dtype`` (default: the model's dtype) is the dtype of
    the KV cache :meth:`forward` will be given; with the device it picks ``kernels``."""

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor],
                 max_positions: int, fuse: bool | None = None,
                 vocab_limit: int | None = None, quantization: str | None = None,
                 tp: TensorParallel | None = None,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.tp = tp
        ranks = tp.world_size if tp is not None else 1
        # ids at or past ``vocab_limit`` get logit -inf (never sampled): a dummy model that
        # borrows a smaller tokenizer only emits ids that tokenizer can decode
        self.vocab_limit = vocab_limit
        self.num_heads = config.num_attention_heads // ranks
        self.num_kv_heads = config.num_key_value_heads // ranks
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.embed = weights["model.embed_tokens.weight"]  # this rank's rows of the vocabulary
        self.vocab_size = self.embed.shape[0] * ranks
        self.vocab_start = self.embed.shape[0] * (tp.rank if tp is not None else 0)
        self.final_norm = weights["model.norm.weight"]
        self.lm_head: Weight = weights.get("lm_head.weight", self.embed)
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.kv_cache_dtype = kv_cache_dtype or self.dtype
        self.kernels: ReferenceKernels = model_kernels(self.device, self.kv_cache_dtype)
        quantization = resolve_quantization(quantization, self.device)
        check_quantization(quantization, self.device)
        if quantization is not None:
            logger.info("quantizing the linear layers to %s (%s)", quantization, self.device)
        self.layers = [self._layer(weights, i) for i in range(config.num_hidden_layers)]
        # CUDA: one GEMM for q/k/v and one for gate/up (fewer, larger kernels per step).
        # CPU keeps transformers' op-for-op numerics unless it quantizes.
        fused = (self.device.type == "cuda" or quantization is not None) if fuse is None else fuse
        if fused:
            for i, layer in enumerate(self.layers):
                self._fuse(weights, i, layer)
        if quantization is not None:
            for layer in self.layers:
                self._quantize(layer, quantization)
        if quantization in CPU_QUANTIZATIONS:
            self.lm_head = Int8Linear(self.lm_head)  # see engine/quantization.py
        rotary = LlamaRotaryEmbedding(config).to(self.device)
        positions = torch.arange(max_positions, device=self.device)[None, :]
        cos, sin = rotary(self.embed[:1], positions)
        self.cos, self.sin = cos[0], sin[0]
        # the norm after each layer's MLP: the next layer's input norm, then the final norm
        self.next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        # each layer's (k_scale, v_scale) for an FP8 KV cache (set by the runner; see
        # chatgate_kernels)
        self.kv_scales = [(1.0, 1.0)] * len(self.layers)

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

    @staticmethod
    def _quantize(layer: _Layer, quantization: str) -> None:
        """Quantized layers in place of the fused layer's matrices (the float ones are
        dropped)."""
        assert layer.qkv is not None and layer.gate_up is not None
        layer.qkv = quantized_linear(quantization, layer.qkv, layer.qkv_bias)
        layer.qkv_bias = None
        layer.gate_up = quantized_linear(quantization, layer.gate_up)
        layer.o = quantized_linear(quantization, layer.o)
        layer.down = quantized_linear(quantization, layer.down)
        empty = layer.input_norm.new_empty(0)
        layer.q = layer.k = layer.v = layer.gate = layer.up = empty

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm; writes this step's K/V
        into ``kv_cache [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]``."""
        h = self._embed(input_ids)  # the residual stream, updated in place
        x = self._input_norm(h)
        cos, sin = self.cos[positions], self.sin[positions]
        return self._decoder_layers(x, h, cos, sin, meta, kv_cache)

    def _input_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The first layer's input: its input norm of the embeddings ``h``."""
        return self.kernels.rms_norm(h, self.layers[0].input_norm, self.eps)

    def _decoder_layers(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, meta: AttentionMetadata,
                        kv_cache: torch.Tensor) -> torch.Tensor:
        """Every decoder layer over the first layer's input ``x`` and the residual stream
        ``h``, with the tokens' rotary rows ``cos``/``sin``: the final norm's output."""
        n, kernels = x.shape[0], self.kernels
        last = len(self.layers) - 1
        for index, (layer, next_norm, (k_scale, v_scale)) in enumerate(
                zip(self.layers, self.next_norms, self.kv_scales, strict=True)):
            q, k, v = self._qkv(layer, x)
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            v = v.view(n, self.num_kv_heads, self.head_dim)
            key_cache, value_cache = kv_cache[0, index], kv_cache[1, index]
            kernels.rotary_and_cache(q, k, v, cos, sin, key_cache, value_cache,
                                     meta.slot_mapping, k_scale, v_scale, meta.plan)
            o = kernels.paged_attention(
                q, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, self.scale, meta.max_query_len, meta.max_seq_len,
                out=meta.attn_out, plan=meta.plan, k_scale=k_scale, v_scale=v_scale,
                row_order=meta.row_order, extend_tiles=meta.extend_tiles,
            )
            x = self._add_norm(self._reduced(_linear(o.reshape(n, -1), layer.o)), h,
                               layer.post_norm, final=False)
            x = self._add_norm(self._reduced(_linear(self._gated(layer, x), layer.down)), h,
                               next_norm, final=index == last)
        return x

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  final: bool) -> torch.Tensor:
        """``residual += x``, then its RMSNorm: the next linear layer's input, or with
        ``final`` the hidden states (the same here; not in the quantized CPU model)."""
        return self.kernels.add_rms_norm(x, residual, weight, self.eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ``input_ids``; with tensor parallelism each rank looks up the ids
        in its vocabulary rows (zeros for the others) and the ranks' rows are summed."""
        if self.tp is None:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0.0))

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-split layer's output: summed over the ranks (as it is, without them)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _qkv(self, layer: _Layer, x: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if layer.qkv is not None:
            # a quantized product of bfloat16 inputs is bfloat16: rotary and cache take the
            # model's dtype
            qkv = _linear(x, layer.qkv, layer.qkv_bias).to(self.dtype)
            kv = self.num_kv_heads * self.head_dim
            return qkv.split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        return (F.linear(x, layer.q, layer.q_bias), F.linear(x, layer.k, layer.k_bias),
                F.linear(x, layer.v, layer.v_bias))

    def _gated(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate(x)) * up(x)``."""
        if layer.gate_up is not None:
            return self._silu_and_mul(_linear(x, layer.gate_up))
        return F.silu(F.linear(x, layer.gate)) * F.linear(x, layer.up)

    def _silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused ``gate_up`` product."""
        return self.kernels.silu_and_mul(gate_up)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, as transformers computes them; the sampler upcasts
        only where it needs float32 (softmax, logprobs): a greedy row is its argmax."""
        logits = _linear(hidden, self.lm_head)
        if self.tp is not None:
            logits = self.tp.all_gather_last(logits)
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits[:, self.vocab_limit:] = float("-inf")
        return logits
