// Decoding GGML blocks (the byte layouts of ggml-common.h; checked against gguf.quants in
// tests/test_quant_kernels.py).
#include "ggml_blocks.h"

#include <stdexcept>
#include <string>

namespace powerinfer {
namespace {

uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

uint16_t negated(uint16_t half_bits) { return half_bits ^ 0x8000; }

// Q4_K, Q5_K: 8 scales and 8 minimums of 6 bits in 12 bytes: entries 0-3 in the low 6 bits of
// bytes 0-3 (scales) and 4-7 (minimums); entries 4-7 in the nibbles of bytes 8-11 (scale low,
// minimum high), their top 2 bits in the top 2 bits of bytes 0-3 (scales) and 4-7 (minimums).
void scales_6bit_pairs(const uint8_t* s, BlockScales& out) {
  for (int j = 0; j < 4; ++j) {
    out.sc[j] = static_cast<int8_t>(s[j] & 63);
    out.mn[j] = s[j + 4] & 63;
    out.sc[j + 4] = static_cast<int8_t>((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
    out.mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Q3_K: 16 scales of 6 bits (minus 32) in 12 bytes: scale j has its low 4 bits in nibble j / 8 of
// byte j % 8, its top 2 bits in bits 2 (j / 4) of byte 8 + j % 4.
void scales_q3_k(const uint8_t* s, BlockScales& out) {
  for (int j = 0; j < 16; ++j) {
    const int low = (s[j % 8] >> (4 * (j / 8))) & 0x0F;
    const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    out.sc[j] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
}

// Block layouts (bytes): Q4_0 d qs[16]; Q4_1 d m qs[16]; Q5_0 d qh[4] qs[16]; Q5_1 d m qh[4] qs[16];
// Q8_0 d qs[32]; Q2_K scales[16] qs[64] d dmin; Q3_K hmask[32] qs[64] scales[12] d;
// Q4_K d dmin scales[12] qs[128]; Q5_K d dmin scales[12] qh[32] qs[128]; Q6_K ql[128] qh[64] scales[16] d.

// Q4_x, Q5_x: byte j of qs holds weight j (low nibble) and j + 16 (high nibble); Q5_x add bit j of
// the 32-bit qh as bit 4 of weight j.
void q_legacy(const BlockFormat& f, const uint8_t* b, uint8_t* q) {
  const uint8_t* qs = b + (f.has_min ? 4 : 2);
  if (f.type == GgmlType::Q8_0) {
    for (int k = 0; k < QK; ++k) q[k] = qs[k] ^ 0x80;  // int8 + 128
    return;
  }
  uint32_t qh = 0;
  if (f.q_bits == 5) {
    std::memcpy(&qh, qs, 4);
    qs += 4;
  }
  for (int j = 0; j < QK / 2; ++j) {
    q[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    q[j + QK / 2] = (qs[j] >> 4) | (((qh >> (j + QK / 2)) & 1) << 4);
  }
}

// Q4_K, Q5_K: each 64 weights, 32 bytes: low nibbles the first 32 weights, high nibbles the next
// 32; Q5_K: bit 2c of qh[l] is bit 4 of weight 64c + l, bit 2c + 1 that of weight 64c + 32 + l.
void q_q4_k(const uint8_t* b, bool five_bits, uint8_t* q) {
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (five_bits ? 48 : 16);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = qs[32 * c + l];
      const int high = five_bits ? qh[l] >> (2 * c) : 0;
      q[64 * c + l] = (byte & 0x0F) | ((high & 1) << 4);
      q[64 * c + 32 + l] = (byte >> 4) | (((high >> 1) & 1) << 4);
    }
}

// Q6_K, per half of 128 weights (ql: 64 bytes, qh: 32 bytes): weight 32i + l takes nibble i / 2
// (low for i < 2) of ql[l + 32 (i % 2)], and bits 2i, 2i + 1 of qh[l] as its bits 4, 5.
void q_q6_k(const uint8_t* b, uint8_t* q) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) {
        const uint8_t low = ql[l + 32 * (i % 2)] >> (4 * (i / 2));
        q[128 * h + 32 * i + l] = (low & 0x0F) | (((qh[l] >> (2 * i)) & 3) << 4);
      }
  }
}

// Q2_K, Q3_K, per half of 128 weights (32 bytes of qs): weight 32i + l is bits 2i, 2i + 1 of byte
// l. Q3_K: bit 4h + i of hmask[l] is bit 2 (a set bit means q - 4 >= 0).
void q_q2_q3_k(const uint8_t* qs, const uint8_t* hmask, uint8_t* q) {
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) {
        const int low = (qs[32 * h + l] >> (2 * i)) & 3;
        const int high = hmask ? (hmask[l] >> (4 * h + i)) & 1 : 0;
        q[128 * h + 32 * i + l] = static_cast<uint8_t>(low | (high << 2));
      }
}

}  // namespace

const BlockFormat& block_format(int64_t type) {
  const BlockFormat* f = find_format(type);
  if (f == nullptr) throw std::invalid_argument("GGML type " + std::to_string(type) + " is not a block format we keep");
  return *f;
}

void decode_scales(const BlockFormat& f, const uint8_t* b, BlockScales& out) {
  out.dmin = 0;
  switch (f.type) {
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
      out.d = u16(b);
      out.dmin = negated(u16(b + 2));
      return scales_6bit_pairs(b + 4, out);
    case GgmlType::Q6_K:
      for (int j = 0; j < 16; ++j) out.sc[j] = static_cast<int8_t>(b[192 + j]);
      out.d = u16(b + 208);
      return;
    case GgmlType::Q2_K:
      for (int j = 0; j < 16; ++j) out.sc[j] = static_cast<int8_t>(b[j] & 0x0F), out.mn[j] = b[j] >> 4;
      out.d = u16(b + 80);
      out.dmin = negated(u16(b + 82));
      return;
    case GgmlType::Q3_K:
      out.d = u16(b + 108);
      return scales_q3_k(b + 96, out);
    default:
      out.d = u16(b);
      if (f.has_min) out.dmin = u16(b + 2);
      out.sc[0] = 1;
      out.mn[0] = 1;
  }
}

void decode_block(const BlockFormat& f, const uint8_t* block, DecodedBlock& out) {
  decode_scales(f, block, out);
  switch (f.type) {
    case GgmlType::Q4_K: return q_q4_k(block, false, out.q);
    case GgmlType::Q5_K: return q_q4_k(block, true, out.q);
    case GgmlType::Q6_K: return q_q6_k(block, out.q);
    case GgmlType::Q2_K: return q_q2_q3_k(block + 16, nullptr, out.q);
    case GgmlType::Q3_K: return q_q2_q3_k(block + 32, block, out.q);
    default: return q_legacy(f, block, out.q);
  }
}

}  // namespace powerinfer
