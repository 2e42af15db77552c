"""Building blocks shared by architectures: embedding, norms, rotary embedding, attention, the
pre-norm decoder block."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from powerinfer.config import ModelConfig
from powerinfer.gguf.reader import GGUFFile, GGUFTensor
from powerinfer.ops.linear import CPU, Linear, float_vector, mapped_tensor
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
        dim = weight.shape[-1]  # a [heads, head_dim] weight normalizes each head with its own row
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


class RotaryEmbedding:
    """RoPE as complex rotations, precomputed for every position of the context.

    `interleaved` rotates adjacent pairs (GGML's normal mode, used for llama: the converter
    permutes Q and K rows so this equals Hugging Face's half-split rotation); otherwise the two
    halves of the head are paired (GGML's NeoX mode). Only the first `rope_dim` values of a head
    rotate (partial rotary embedding; default all); `attn_factor` scales the rotated values
    (LongRoPE's magnitude correction, as GGML applies it).
    """

    def __init__(self, head_dim: int, n_ctx: int, base: float, scale: float = 1.0,
                 freq_factors: torch.Tensor | None = None, interleaved: bool = True, rope_dim: int | None = None,
                 attn_factor: float = 1.0):
        self.rope_dim = rope_dim or head_dim
        inv_freq = base ** (-torch.arange(0, self.rope_dim, 2, dtype=torch.float64) / self.rope_dim)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        angles = torch.outer(torch.arange(n_ctx, dtype=torch.float64) / scale, inv_freq)
        # [n_ctx, 1, rope_dim / 2]: broadcasts over heads
        magnitude = torch.full_like(angles, attn_factor)
        self.rotations = torch.polar(magnitude, angles).to(torch.complex64).unsqueeze(1)
        self.interleaved = interleaved
        self.head_dim = head_dim

    def to(self, device: torch.device) -> RotaryEmbedding:
        """The same rotations on `device` (a copy; self when already there)."""
        if self.rotations.device == device:
            return self
        moved = copy.copy(self)
        moved.rotations = self.rotations.to(device)
        return moved

    def __call__(self, x: torch.Tensor, positions: torch.Tensor | slice) -> torch.Tensor:
        """x: [tokens, heads, head_dim] float32 -> rotated copy."""
        rot = self.rotations[positions]
        if self.rope_dim < self.head_dim:
            return torch.cat([self._rotate(x[..., : self.rope_dim], rot), x[..., self.rope_dim :]], dim=-1)
        return self._rotate(x, rot)

    def _rotate(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * rot).view(x.shape)
        half = self.rope_dim // 2
        pairs = torch.complex(x[..., :half], x[..., half:]) * rot
        return torch.cat([pairs.real, pairs.imag], dim=-1)


def _positions(spans: Sequence[SeqSpan]) -> torch.Tensor | slice:
    if len(spans) == 1:
        return slice(spans[0].start, spans[0].end)
    return torch.cat([torch.arange(s.start, s.end) for s in spans])


@dataclass(frozen=True)
class AttentionOptions:
    """What some architectures add to plain attention: `qk_norm`, an RMSNorm per head of Q and K
    before RoPE (Qwen3, Gemma 3; one [q + kv heads, head_dim] weight); a sliding `window` (a query
    sees keys fewer than `window` positions back; 0: all); the query-key `scale` (0: 1/sqrt(head_dim));
    `softcap`: scores -> softcap * tanh(scores / softcap) (0: none)."""

    qk_norm: RMSNorm | None = None
    window: int = 0
    scale: float = 0.0
    softcap: float = 0.0

    def to(self, device: torch.device) -> AttentionOptions:
        return dataclasses.replace(self, qk_norm=None if self.qk_norm is None else self.qk_norm.to(device))


PLAIN = AttentionOptions()


def attention_options(gguf: GGUFFile, layer: int, config: ModelConfig) -> AttentionOptions:
    """Block `layer`'s attention options as the file and its configuration state them."""
    windowed = bool(config.swa_layers) and config.swa_layers[layer]
    norms = head_norms(gguf, f"blk.{layer}.", config.n_head, config.n_head_kv, config.norm_eps)
    return AttentionOptions(norms, config.sliding_window if windowed else 0, config.attention_scale, config.attn_softcap)


def head_norms(gguf: GGUFFile, prefix: str, n_head: int, n_head_kv: int, eps: float) -> RMSNorm | None:
    """`prefix`attn_q_norm and attn_k_norm (RMSNorms over one head) as one norm of the Q and K heads,
    or None when the file has neither."""
    q, k = (gguf.tensors.get(f"{prefix}{name}.weight") for name in ("attn_q_norm", "attn_k_norm"))
    if q is None and k is None:
        return None
    rows = [float_vector(q).expand(n_head, -1), float_vector(k).expand(n_head_kv, -1)]
    return RMSNorm(torch.cat(rows).contiguous(), eps)


class Attention:
    """Multi-head attention with grouped KV heads and a KV cache; without `rope` the positions
    come from elsewhere (OPT's learned position embeddings). `options`: see AttentionOptions.

    Written with few torch calls: at batch 1 the per-call overhead, not arithmetic, is what the
    non-matmul part of a decode step costs.
    """

    def __init__(self, layer: int, qkv: Linear, output: Linear, n_head: int, n_head_kv: int, head_dim: int,
                 rope: RotaryEmbedding | None, options: AttentionOptions = PLAIN):
        self.layer, self.qkv, self.output, self.rope = layer, qkv, output, rope
        self.n_head, self.n_head_kv, self.head_dim = n_head, n_head_kv, head_dim
        self.qk_dim = (n_head + n_head_kv) * head_dim
        self.options = options

    def to(self, device: torch.device) -> Attention:
        return Attention(self.layer, self.qkv.to(device), self.output.to(device), self.n_head, self.n_head_kv,
                         self.head_dim, None if self.rope is None else self.rope.to(device), self.options.to(device))

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.output.nbytes

    def __call__(self, h: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache) -> torch.Tensor:
        n = h.shape[0]
        qkv = self.qkv(h).float()
        qk = qkv[:, : self.qk_dim].view(n, self.n_head + self.n_head_kv, self.head_dim)
        if self.options.qk_norm is not None:
            qk = self.options.qk_norm(qk)
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
        window = self.options.window
        if n == 1:  # [1, heads, 1, hd] are views of the one token's rows: no transposes needed
            keys, values = cache.store(self.layer, span, qk[:, h:].view(1, -1, 1, hd), v.view(1, -1, 1, hd))
            if window and span.end > window:  # the keys the window leaves
                keys, values = keys[:, :, span.end - window :], values[:, :, span.end - window :]
            q, keys, values = _in_compute_dtype(qk[:, :h].view(1, h, 1, hd), keys, values)
            return self._scores(q, keys, values).view(1, h * hd).float()
        keys, values = cache.store(self.layer, span, qk[:, h:].transpose(0, 1)[None], v.transpose(0, 1)[None])
        q, keys, values = _in_compute_dtype(qk[:, :h].transpose(0, 1)[None], keys, values)  # q: [1, heads, n, hd]
        if span.start == 0 and not window:
            out = self._scores(q, keys, values, is_causal=True)
        else:  # token i sees keys up to start + i (and, with a window, fewer than `window` back)
            keys_at = torch.arange(span.end, device=q.device)
            back = keys_at[span.start :, None] - keys_at[None, :]
            visible = back >= 0 if not window else (back >= 0) & (back < window)
            out = self._scores(q, keys, values, attn_mask=visible)
        return out[0].transpose(0, 1).reshape(n, h * hd).float()

    def _scores(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **mask) -> torch.Tensor:
        o = self.options
        if o.softcap:
            return _softcapped_attention(q, keys, values, o.scale or self.head_dim**-0.5, o.softcap, **mask)
        return _attention(q, keys, values, scale=o.scale or None, **mask)


def _in_compute_dtype(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, keys and values in the dtype attention computes in: the cache's (float16) on an
    accelerator; float32 on the CPU, whose float16 arithmetic is slow (the cache is widened as read)."""
    if keys.device.type == "cpu":
        return q, keys.float(), values.float()
    return q.to(keys.dtype), keys, values


# On CUDA, cuDNN's attention builds a new graph for every key length: about 16 ms of CPU time per
# decode step and layer (measured on an H100); the other backends need none.
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kwargs) -> torch.Tensor:
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True, **kwargs)
    with sdpa_kernel(CUDA_ATTENTION):
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True, **kwargs)


def _softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, softcap: float,
                          attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """Attention whose scores are soft-capped before the softmax (which torch's fused kernels do not
    offer). q [1, heads, n, hd], keys and values [1, kv heads, L, hd]."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.tanh((q @ keys.transpose(-1, -2)) * (scale / softcap)) * softcap
    if is_causal:
        n, length = scores.shape[-2:]
        attn_mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


class DecoderBlock:
    """What every architecture's block has: dense parts (the attributes named in `DENSE_PARTS`:
    norms, attention) on `device`, where x is moved on entry and stays; an FFN that takes its input
    on that device (a hybrid FFN returns its result there too); and an observer hook.

    Blocks are built on the CPU; placement moves them with `to` and may replace `ffn`.
    """

    DENSE_PARTS: tuple[str, ...] = ()

    def __init__(self, ffn):
        self.device = CPU
        self.offloaded = False  # moved by placement (to an accelerator, or to the CPU standing in for one)
        # Called as observer(unit, residual, activations) when set (profiling, predictor training): unit
        # is the FFN unit (`ModelConfig.ffn_unit`), the layer for a block with one FFN.
        self.observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        self.ffn = ffn  # last: a block may build on it what needs its other parts (llama's native step)

    def rebuild_step(self) -> None:
        """Called after a part's linear is replaced in place: a block whose decode step holds its
        weights builds it again (llama's native step); others hold none."""

    def to(self, device: torch.device) -> DecoderBlock:
        """Move the dense parts (not the FFN) to `device`, in place, as torch modules do."""
        for name in self.DENSE_PARTS:
            part = getattr(self, name)
            if part is not None:
                setattr(self, name, part.to(device))
        self.device, self.offloaded = device, True
        return self


class Block(DecoderBlock):
    """A pre-norm decoder block: x + attention(attn_norm(x)), then + ffn(ffn_norm(x)) (llama, OPT).
    With post norms (Gemma 3's sandwich) what attention and the FFN return is normalized before it
    is added: x + post_attention_norm(attention(...)), then + post_ffw_norm(ffn(...))."""

    DENSE_PARTS = ("attn_norm", "attention", "post_attention_norm", "ffn_norm", "post_ffw_norm")

    def __init__(self, attn_norm, attention: Attention, ffn_norm, ffn, post_attention_norm=None, post_ffw_norm=None):
        self.attn_norm, self.attention, self.ffn_norm = attn_norm, attention, ffn_norm
        self.post_attention_norm, self.post_ffw_norm = post_attention_norm, post_ffw_norm
        super().__init__(ffn)

    def __call__(self, x: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache) -> torch.Tensor:
        x = x.to(self.device)
        x = x + _normalized(self.post_attention_norm, self.attention(self.attn_norm(x), spans, cache))
        h = self.ffn_norm(x)
        y = observe_ffn(self, h, x) if self.observer is not None else self.ffn(h, x)
        return x.add_(_normalized(self.post_ffw_norm, y))


def _normalized(post_norm, y: torch.Tensor) -> torch.Tensor:
    """y, through the post norm where the block has one."""
    return y if post_norm is None else post_norm(y.float())


def observe_ffn(block, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The FFN output, its activations shown to `block.observer` on the way (by FFN unit: a mixture
    of experts shows each expert its own rows). Observed FFNs compute on the CPU (a hybrid FFN's
    `activations` and `project` use its full CPU store)."""
    return block.ffn.observed(h.cpu(), residual.cpu(), block.observer, block.attention.layer).to(residual.device)
