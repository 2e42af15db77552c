"""The native decode attention (attention.cpp), on each instruction set, against torch's RoPE and
scaled_dot_product_attention, with each option of AttentionSpec."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from powerinfer.models.layers import RotaryEmbedding, _softcapped_attention
from powerinfer.ops import native

N_HEAD, N_KV, N_CTX, SLOTS = 6, 2, 700, 3
# in vector registers (AVX-512: multiples of 16, AVX2: of 8; 256, Gemma's: wider than the registers
# hold, in pieces), else plain loops
HEAD_DIMS = [64, 16, 24, 20, 256]
ROWS = [(2, 5), (0, 0), (1, 650), (2, 17)]  # (slot, position): two rows share slot 2's cache
# (NeoX pairs, share of the head RoPE rotates, window, scale, soft cap): llama's plain attention,
# then what Qwen, Phi-3 (partial NeoX RoPE, a window), Gemma 3 (a window, its query scale) and
# Gemma 2 (soft-capped scores) add
OPTIONS = {"plain": (False, 1.0, 0, 0.0, 0.0), "neox": (True, 1.0, 0, 0.0, 0.0),
           "partial-neox-window": (True, 0.5, 12, 0.0, 0.0), "window-scale": (True, 1.0, 8, 0.3, 0.0),
           "softcap": (False, 1.0, 0, 0.0, 1.5)}

ops = native.load()
pytestmark = pytest.mark.skipif(ops is None, reason="native operators could not be built here")


def inputs(seed: int, head_dim: int, rope: RotaryEmbedding, cache_dtype: torch.dtype = torch.float32
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(len(ROWS), (N_HEAD + 2 * N_KV) * head_dim, generator=g)
    keys = torch.randn(SLOTS, N_KV, N_CTX, head_dim, generator=g).to(cache_dtype)
    values = torch.randn(SLOTS, N_KV, N_CTX, head_dim, generator=g).to(cache_dtype)
    return qkv, keys, values, rope.rotations[[pos for _, pos in ROWS]]


def rope_of(head_dim: int, neox: bool = False, share: float = 1.0) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, N_CTX, 10000.0, interleaved=not neox, rope_dim=int(head_dim * share) // 2 * 2)


def run(qkv, keys, values, rotations, rows, spec) -> torch.Tensor:
    return ops.decode_attention(qkv[rows].clone(), keys, values, [ROWS[r][0] for r in rows], [ROWS[r][1] for r in rows],
                                rotations[rows], spec)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_equals_torch_reference(head_dim, option, cache_dtype, isa):
    """The reference attends over the cache as torch stores it: float16 keys and values rounded,
    then widened to float32."""
    neox, share, window, scale, softcap = OPTIONS[option]
    rope = rope_of(head_dim, neox, share)
    spec = ops.AttentionSpec(N_HEAD, N_KV, rope.rope_dim, neox=neox, window=window, scale=scale, softcap=softcap)
    qkv, keys, values, rotations = inputs(0, head_dim, rope, cache_dtype)
    ref_keys, ref_values = keys.clone(), values.clone()
    got = run(qkv, keys, values, rotations, list(range(len(ROWS))), spec)
    qk_dim = (N_HEAD + N_KV) * head_dim
    for row, (slot, pos) in enumerate(ROWS):
        qk = rope(qkv[row, :qk_dim].view(1, N_HEAD + N_KV, head_dim), slice(pos, pos + 1))[0]
        ref_keys[slot, :, pos] = qk[N_HEAD:]
        ref_values[slot, :, pos] = qkv[row, qk_dim:].view(N_KV, head_dim)
        first = max(0, pos + 1 - window) if window else 0
        k, v = (c[slot : slot + 1, :, first : pos + 1].float() for c in (ref_keys, ref_values))
        if softcap:
            expected = _softcapped_attention(qk[None, :N_HEAD, None], k, v, scale or head_dim**-0.5, softcap)
        else:
            expected = F.scaled_dot_product_attention(qk[None, :N_HEAD, None], k, v, enable_gqa=True, scale=scale or None)
        # float32 rounding in the scores grows with the dot products' length
        torch.testing.assert_close(got[row], expected.flatten(), rtol=1e-5, atol=1e-6 * max(1, head_dim // 64))
    torch.testing.assert_close(keys, ref_keys, rtol=1e-6, atol=1e-6)  # float16: bit-equal (same rounding)
    assert torch.equal(values, ref_values)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_each_row_gets_its_single_row_result_exactly(head_dim, isa):
    """Rows alone or together, serial or spread over threads: the same bits."""
    rope = rope_of(head_dim)
    spec = ops.AttentionSpec(N_HEAD, N_KV, rope.rope_dim)
    qkv, keys, values, rotations = inputs(1, head_dim, rope)
    together = run(qkv, keys.clone(), values.clone(), rotations, [1, 2, 3], spec)
    for i, row in enumerate([1, 2, 3]):
        assert torch.equal(together[i], run(qkv, keys.clone(), values.clone(), rotations, [row], spec)[0])


def test_rejects_out_of_range_positions():
    rope = rope_of(16)
    qkv, keys, values, rotations = inputs(2, 16, rope)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.decode_attention(qkv[:1].clone(), keys, values, [0], [N_CTX], rotations[:1],
                             ops.AttentionSpec(N_HEAD, N_KV, rope.rope_dim))
