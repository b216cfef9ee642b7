"""The floor model: the least time the hardware needs for an engine step, from the model's
shapes and measured hardware numbers (the sustained matmul rate, the copy bandwidth, the L2
size). A step of ``tokens`` rows through the decoder layers, ``rows`` of them through lm_head,
over ``kv_bytes`` of cached keys and values, has three floors:

- ``floor_s``: the larger of its FLOPs at the matmul rates and its bytes (every weight once,
  plus the KV) at the copy bandwidth;
- ``serial_s``: its GEMMs (each at the larger of its FLOPs and its weight bytes), then its KV
  reads, as a layer's dependencies order them within one batch;
- ``overlap_s``: between the two, attention beside every GEMM those dependencies allow
  (:func:`overlap_floor_s`).

Always ``floor_s <= overlap_s <= serial_s``. Everything here is arithmetic on numbers except
reading them off a model (:meth:`WeightSplit.of`, :func:`decode_weight_bytes`,
:func:`kv_bytes_per_token`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization import Fp8Linear

Rates = tuple[float, float]  # FLOP/s of the decoder layers' products, of lm_head's


@dataclass(frozen=True)
class WeightSplit:
    """A model's weights as the floors split them: every decoder layer's (norms included), the
    MLP's share of them, and lm_head's."""

    layers: int
    params: int
    bytes_per_param: float
    mlp_params: int  # gate, up and down of every layer
    head_params: int
    head_bytes_each: int

    @classmethod
    def of(cls, model) -> WeightSplit:
        params = layer_params(model)
        down = model.layers[0].down
        down_params = (down if isinstance(down, torch.Tensor) else down.weight).numel()
        return cls(len(model.layers), params, layer_weight_bytes(model) / params,
                   3 * len(model.layers) * down_params, model.lm_head.numel(),
                   model.lm_head.element_size())

    @property
    def weight_bytes(self) -> float:
        """Bytes of the decoder layers and lm_head."""
        return self.params * self.bytes_per_param + self.head_params * self.head_bytes_each


def _layer_storages(model) -> dict[int, tuple[int, int]]:
    """Every decoder layer's storages once (fused q/k/v and gate/up are views), an FP8
    product's codes, scales and bias included: data pointer -> (bytes, weights; a scale is
    not a weight)."""
    storages = {}
    for layer in model.layers:
        for value in vars(layer).values():
            tensors = [(value, True)] if isinstance(value, torch.Tensor) else []
            if isinstance(value, Fp8Linear):
                tensors = [(value.weight, True), (value.scales, False)]
                tensors += [(value.bias, True)] if value.bias is not None else []
            for t, weights in tensors:
                storage = t.untyped_storage()
                count = storage.nbytes() // t.element_size() if weights else 0
                storages[storage.data_ptr()] = (storage.nbytes(), count)
    return storages


def layer_weight_bytes(model) -> int:
    """Bytes of every decoder layer's tensors."""
    return sum(nbytes for nbytes, _ in _layer_storages(model).values())


def layer_params(model) -> int:
    """Weights of every decoder layer (norms included)."""
    return sum(count for _, count in _layer_storages(model).values())


def decode_weight_bytes(model, batch: int) -> int:
    """Bytes a decode step of ``batch`` rows reads besides the KV: every decoder layer, the
    final norm, lm_head and the rows' embeddings."""
    return (layer_weight_bytes(model) + model.final_norm.numel() * model.final_norm.element_size()
            + model.lm_head.numel() * model.lm_head.element_size()
            + batch * model.embed.shape[1] * model.embed.element_size())


def kv_bytes_per_token(model, element_size: int) -> int:
    """Bytes of one token's keys and values over every layer, at ``element_size`` each."""
    return 2 * len(model.layers) * model.num_kv_heads * model.head_dim * element_size


def flop_s(split: WeightSplit, tokens: int, rows: int, rates: Rates) -> float:
    """Seconds of a step's linear layers at ``rates``: ``tokens`` rows through the decoder
    layers, ``rows`` through lm_head."""
    return 2 * (split.params * tokens / rates[0] + split.head_params * rows / rates[1])


def overlap_floor_s(split: WeightSplit, tokens: int, rows: int, kv_bytes: float,
                    rates: Rates, copy_bw: float, l2_bytes: int) -> float:
    """The floor of one step whose attention runs beside every GEMM the layers' data
    dependencies let it run beside, each weight read once (the most a persistent whole-layer
    kernel could overlap): the q/k/v and o products, and the share of the MLP whose weights fit
    in L2 (``l2_bytes``) and so can wait there for rows whose attention ends late. The rest of
    the MLP streams its weights past every row once, so it starts when the layer's attention
    has ended, and lm_head needs the last layer's output: both follow the KV reads. Each GEMM
    costs the larger of its FLOPs at ``rates`` and its weight bytes at ``copy_bw``; ``tokens``
    rows go through the layers, ``rows`` through lm_head. Never below the step's FLOP floor or
    its byte floor (the caller takes the larger)."""

    def gemm_s(count: int, width: int, rate: float, bytes_each: float) -> float:
        return max(2 * width * count / rate, count * bytes_each / copy_bw)

    mlp = gemm_s(split.mlp_params, tokens, rates[0], split.bytes_per_param)
    beside = gemm_s(split.params - split.mlp_params, tokens, rates[0], split.bytes_per_param)
    head = gemm_s(split.head_params, rows, rates[1], split.head_bytes_each)
    resident = min(1.0, l2_bytes * split.layers / (split.mlp_params * split.bytes_per_param))
    return (1 - resident) * mlp + head + max(kv_bytes / copy_bw, beside + resident * mlp)


@dataclass(frozen=True)
class StepFloors:
    """One step's floors (module docstring); ``flop_s`` its linear layers' FLOP time."""

    flop_s: float
    floor_s: float
    serial_s: float
    overlap_s: float


def step_floors(split: WeightSplit, tokens: int, rows: int, kv_bytes: float,
                weight_bytes: float, rates: Rates, copy_bw: float, l2_bytes: int) -> StepFloors:
    """The floors of one step that reads ``weight_bytes`` of weights and ``kv_bytes`` of KV."""
    flops = flop_s(split, tokens, rows, rates)
    weight_s, kv_s = weight_bytes / copy_bw, kv_bytes / copy_bw
    floor = max(flops, weight_s + kv_s)
    overlap = overlap_floor_s(split, tokens, rows, kv_bytes, rates, copy_bw, l2_bytes)
    return StepFloors(flops, floor, max(flops, weight_s) + kv_s, max(floor, overlap))


def workload_floor(split: WeightSplit, kv_token_bytes: int, step_work: list[tuple[int, int]],
                   step_rows: list[int], output_tokens: int, seconds: float, rates: Rates,
                   copy_bw: float, l2_bytes: int) -> dict:
    """The floors of the steps an engine ran, summed: step ``i`` computed ``step_work[i][0]``
    tokens over ``step_work[i][1]`` context tokens (each ``kv_token_bytes`` of KV) and sampled
    ``step_rows[i]`` rows; ``output_tokens`` in ``seconds`` measured. Fractions are floor over
    measured time."""
    total = serial = overlap = 0.0
    for (tokens, ctx), rows in zip(step_work, step_rows, strict=True):
        f = step_floors(split, tokens, rows, kv_token_bytes * ctx, split.weight_bytes, rates,
                        copy_bw, l2_bytes)
        total += f.floor_s
        serial += f.serial_s
        overlap += f.overlap_s
    return {"floor_s": total, "output_tokens_per_s": output_tokens / total,
            "fraction": total / seconds, "matmul_flops": rates[0], "head_flops": rates[1],
            "serial_s": serial, "serial_fraction": serial / seconds,
            "overlap_s": overlap, "overlap_fraction": overlap / seconds}
