"""The native decode attention (attention.cpp), on each instruction set, against torch's RoPE and
scaled_dot_product_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from powerinfer.models.layers import RotaryEmbedding
from powerinfer.ops import native

N_HEAD, N_KV, N_CTX, SLOTS = 6, 2, 700, 3
HEAD_DIMS = [64, 16, 24, 20]  # in vector registers (AVX-512: multiples of 16, AVX2: of 8), else plain loops
ROWS = [(2, 5), (0, 0), (1, 650), (2, 17)]  # (slot, position): two rows share slot 2's cache

ops = native.load()
pytestmark = pytest.mark.skipif(ops is None, reason="native operators could not be built here")


def inputs(seed: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(len(ROWS), (N_HEAD + 2 * N_KV) * head_dim, generator=g)
    keys = torch.randn(SLOTS, N_KV, N_CTX, head_dim, generator=g)
    values = torch.randn(SLOTS, N_KV, N_CTX, head_dim, generator=g)
    rotations = RotaryEmbedding(head_dim, N_CTX, 10000.0).rotations[[pos for _, pos in ROWS]]
    return qkv, keys, values, rotations


def run(qkv, keys, values, rotations, rows) -> torch.Tensor:
    return ops.decode_attention(qkv[rows].clone(), keys, values, [ROWS[r][0] for r in rows], [ROWS[r][1] for r in rows],
                                rotations[rows], N_HEAD, N_KV)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_equals_torch_reference(head_dim, isa):
    qkv, keys, values, rotations = inputs(0, head_dim)
    ref_keys, ref_values = keys.clone(), values.clone()
    got = run(qkv, keys, values, rotations, list(range(len(ROWS))))
    qk_dim = (N_HEAD + N_KV) * head_dim
    for row, (slot, pos) in enumerate(ROWS):
        qk = torch.view_as_real(torch.view_as_complex(qkv[row, :qk_dim].view(-1, head_dim // 2, 2)) * rotations[row])
        qk = qk.view(N_HEAD + N_KV, head_dim)
        ref_keys[slot, :, pos] = qk[N_HEAD:]
        ref_values[slot, :, pos] = qkv[row, qk_dim:].view(N_KV, head_dim)
        expected = F.scaled_dot_product_attention(qk[None, :N_HEAD, None], ref_keys[slot : slot + 1, :, : pos + 1],
                                                  ref_values[slot : slot + 1, :, : pos + 1], enable_gqa=True)
        torch.testing.assert_close(got[row], expected.flatten(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(keys, ref_keys, rtol=1e-6, atol=1e-6)
    assert torch.equal(values, ref_values)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_each_row_gets_its_single_row_result_exactly(head_dim, isa):
    """Rows alone or together, serial or spread over threads: the same bits."""
    qkv, keys, values, rotations = inputs(1, head_dim)
    together = run(qkv, keys.clone(), values.clone(), rotations, [1, 2, 3])
    for i, row in enumerate([1, 2, 3]):
        assert torch.equal(together[i], run(qkv, keys.clone(), values.clone(), rotations, [row])[0])


def test_rejects_out_of_range_positions():
    qkv, keys, values, rotations = inputs(2, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.decode_attention(qkv[:1].clone(), keys, values, [0], [N_CTX], rotations[:1], N_HEAD, N_KV)
