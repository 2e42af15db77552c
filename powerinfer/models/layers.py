"""Building blocks shared by architectures: embedding, norms, rotary embedding, attention, the
pre-norm decoder block."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from powerinfer.gguf.reader import GGUFFile, GGUFTensor
from powerinfer.ops.linear import CPU, BiasedLinear, Linear, build_linear, float_vector, mapped_tensor
from powerinfer.ops.quant import dequantize_rows
from powerinfer.runtime.kv_cache import KVCache, SeqSpan


class Embedding:
    """Token embeddings read row by row from the mapped file, dequantized on lookup."""

    def __init__(self, tensor: GGUFTensor):
        self.rows = mapped_tensor(tensor.rows_as_bytes())
        self.ggml_type = tensor.ggml_type
        self.dim = tensor.shape[1]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.rows[tokens], self.ggml_type, self.dim)


class RMSNorm:
    """x * w / sqrt(mean(x^2) + eps), computed as x * (w * sqrt(d)) / hypot(|x|, sqrt(d * eps)).

    The same value (to float32 rounding) from three native kernels instead of the six that
    `F.rms_norm` runs on CPU: at batch 1, per-call overhead is what a norm costs.
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        dim = weight.shape[0]
        self.weight, self.eps = weight.float(), eps
        self.scaled_weight = self.weight * dim**0.5
        self.eps_term = torch.tensor(dim * eps, dtype=torch.float32, device=weight.device).sqrt()

    @classmethod
    def load(cls, gguf: GGUFFile, name: str, eps: float) -> RMSNorm:
        """The norm whose weight is `name`.weight in the file."""
        return cls(float_vector(gguf.tensor(f"{name}.weight")), eps)

    def to(self, device: torch.device) -> RMSNorm:
        return RMSNorm(self.weight.to(device), self.eps)

    @property
    def nbytes(self) -> int:
        return self.scaled_weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), self.eps_term)
        return (x / norm).mul_(self.scaled_weight)


class LayerNorm:
    """(x - mean(x)) / sqrt(var(x) + eps) * w + b (Falcon, OPT)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float):
        self.weight, self.bias, self.eps = weight.float(), bias.float(), eps

    @classmethod
    def load(cls, gguf: GGUFFile, name: str, eps: float) -> LayerNorm:
        """`name`.weight and `name`.bias of the file."""
        return cls(float_vector(gguf.tensor(f"{name}.weight")), float_vector(gguf.tensor(f"{name}.bias")), eps)

    def to(self, device: torch.device) -> LayerNorm:
        return LayerNorm(self.weight.to(device), self.bias.to(device), self.eps)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.bias.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def projection_builder(gguf: GGUFFile, float32: bool) -> Callable[..., Linear]:
    """`linear(*weight_names)`: one linear layer from weight tensors that share their input, plus
    their biases (`<name>.bias`) when the file has them (a part without one gets zeros)."""

    def linear(*names: str) -> Linear:
        tensors = [gguf.tensor(n) for n in names]
        layer = build_linear(tensors, float32)
        biases = [gguf.tensors.get(n.removesuffix(".weight") + ".bias") for n in names]
        if all(b is None for b in biases):
            return layer
        return BiasedLinear(layer, torch.cat([torch.zeros(t.shape[0]) if b is None else float_vector(b)
                                              for t, b in zip(tensors, biases)]))

    return linear


class RotaryEmbedding:
    """RoPE as complex rotations, precomputed for every position of the context.

    `interleaved` rotates adjacent pairs (GGML's normal mode, used for llama: the converter
    permutes Q and K rows so this equals Hugging Face's half-split rotation); otherwise the two
    halves of the head are paired (GGML's NeoX mode).
    """

    def __init__(self, head_dim: int, n_ctx: int, base: float, scale: float = 1.0,
                 freq_factors: torch.Tensor | None = None, interleaved: bool = True):
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        angles = torch.outer(torch.arange(n_ctx, dtype=torch.float64) / scale, inv_freq)
        # [n_ctx, 1, head_dim / 2]: broadcasts over heads
        self.rotations = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).unsqueeze(1)
        self.interleaved = interleaved
        self.head_dim = head_dim

    def to(self, device: torch.device) -> "RotaryEmbedding":
        """The same rotations on `device` (a copy; self when already there)."""
        if self.rotations.device == device:
            return self
        moved = copy.copy(self)
        moved.rotations = self.rotations.to(device)
        return moved

    def __call__(self, x: torch.Tensor, positions: torch.Tensor | slice) -> torch.Tensor:
        """x: [tokens, heads, head_dim] float32 -> rotated copy."""
        rot = self.rotations[positions]
        if self.interleaved:
            return torch.view_as_real(torch.view_as_complex(x.view(*x.shape[:-1], -1, 2)) * rot).view(x.shape)
        half = self.head_dim // 2
        pairs = torch.complex(x[..., :half], x[..., half:]) * rot
        return torch.cat([pairs.real, pairs.imag], dim=-1)


def _positions(spans: Sequence[SeqSpan]) -> torch.Tensor | slice:
    if len(spans) == 1:
        return slice(spans[0].start, spans[0].end)
    return torch.cat([torch.arange(s.start, s.end) for s in spans])


class Attention:
    """Multi-head attention with grouped KV heads and a KV cache; without `rope` the positions
    come from elsewhere (OPT's learned position embeddings).

    Written with few torch calls: at batch 1 the per-call overhead, not arithmetic, is what the
    non-matmul part of a decode step costs.
    """

    def __init__(self, layer: int, qkv: Linear, output: Linear, n_head: int, n_head_kv: int, head_dim: int,
                 rope: RotaryEmbedding | None):
        self.layer, self.qkv, self.output, self.rope = layer, qkv, output, rope
        self.n_head, self.n_head_kv, self.head_dim = n_head, n_head_kv, head_dim
        self.qk_dim = (n_head + n_head_kv) * head_dim

    def to(self, device: torch.device) -> Attention:
        return Attention(self.layer, self.qkv.to(device), self.output.to(device), self.n_head, self.n_head_kv,
                         self.head_dim, None if self.rope is None else self.rope.to(device))

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.output.nbytes

    def __call__(self, h: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache) -> torch.Tensor:
        n = h.shape[0]
        qkv = self.qkv(h).float()
        qk = qkv[:, : self.qk_dim].view(n, self.n_head + self.n_head_kv, self.head_dim)
        if self.rope is not None:  # Q and K heads are adjacent in the projection, so one rotation covers both
            qk = self.rope(qk, _positions(spans))
        v = qkv[:, self.qk_dim :].view(n, self.n_head_kv, self.head_dim)
        if len(spans) == 1:
            return self.output(self._attend(qk, v, spans[0], cache))
        parts, offset = [], 0
        for span in spans:
            parts.append(self._attend(qk[offset : offset + span.length], v[offset : offset + span.length], span, cache))
            offset += span.length
        return self.output(torch.cat(parts))

    def _attend(self, qk: torch.Tensor, v: torch.Tensor, span: SeqSpan, cache: KVCache) -> torch.Tensor:
        """Store this span's keys/values and attend its queries over the slot. qk: [n, q+kv heads, hd]."""
        n, h, hd = span.length, self.n_head, self.head_dim
        if n == 1:  # [1, heads, 1, hd] are views of the one token's rows: no transposes needed
            keys, values = cache.store(self.layer, span, qk[:, h:].view(1, -1, 1, hd), v.view(1, -1, 1, hd))
            q = qk[:, :h].view(1, h, 1, hd).to(keys.dtype)  # an accelerator's cache may hold float16
            return _attention(q, keys, values).view(1, h * hd).float()
        keys, values = cache.store(self.layer, span, qk[:, h:].transpose(0, 1)[None], v.transpose(0, 1)[None])
        q = qk[:, :h].transpose(0, 1)[None].to(keys.dtype)  # [1, heads, n, hd]
        if span.start == 0:
            out = _attention(q, keys, values, is_causal=True)
        else:  # new tokens after cached ones: token i sees keys up to start + i
            positions = torch.arange(span.end, device=q.device)
            out = _attention(q, keys, values, attn_mask=positions[None, :] <= positions[span.start :, None])
        return out[0].transpose(0, 1).reshape(n, h * hd).float()


# On CUDA, cuDNN's attention builds a new graph for every key length: about 16 ms of CPU time per
# decode step and layer (measured on an H100); the other backends need none.
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kwargs) -> torch.Tensor:
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True, **kwargs)
    with sdpa_kernel(CUDA_ATTENTION):
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True, **kwargs)


class DecoderBlock:
    """What every architecture's block has: dense parts (the attributes named in `DENSE_PARTS`:
    norms, attention) on `device`, where x is moved on entry and stays; an FFN that takes its input
    on that device (a hybrid FFN returns its result there too); and an observer hook.

    Blocks are built on the CPU; placement moves them with `to` and may replace `ffn`.
    """

    DENSE_PARTS: tuple[str, ...] = ()

    def __init__(self, ffn):
        self.ffn = ffn
        self.device = CPU
        self.offloaded = False  # moved by placement (to an accelerator, or to the CPU standing in for one)
        # Called as observer(layer, residual, activations) when set (profiling, predictor training).
        self.observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    def to(self, device: torch.device) -> DecoderBlock:
        """Move the dense parts (not the FFN) to `device`, in place, as torch modules do."""
        for name in self.DENSE_PARTS:
            part = getattr(self, name)
            if part is not None:
                setattr(self, name, part.to(device))
        self.device, self.offloaded = device, True
        return self


class Block(DecoderBlock):
    """A pre-norm decoder block: x + attention(attn_norm(x)), then + ffn(ffn_norm(x)) (llama, OPT)."""

    DENSE_PARTS = ("attn_norm", "attention", "ffn_norm")

    def __init__(self, attn_norm, attention: Attention, ffn_norm, ffn):
        super().__init__(ffn)
        self.attn_norm, self.attention, self.ffn_norm = attn_norm, attention, ffn_norm

    def __call__(self, x: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache) -> torch.Tensor:
        x = x.to(self.device)
        x = x + self.attention(self.attn_norm(x), spans, cache)
        if self.observer is not None:
            return x.add_(observe_ffn(self, self.ffn_norm(x), x))
        return x.add_(self.ffn(self.ffn_norm(x), x))


def observe_ffn(block, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The FFN output, its activations shown to `block.observer` on the way. Observed FFNs compute
    on the CPU (a hybrid FFN's `activations` and `project` use its full CPU store)."""
    activations = block.ffn.activations(h.cpu())
    block.observer(block.attention.layer, residual.cpu(), activations)
    return block.ffn.project(activations).to(residual.device)
