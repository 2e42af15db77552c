// GGML's quantized block formats, decoded one block at a time (scalar code: repacking at load,
// and the kernels' scalar path). Every format is read as
//     w[k] = d * sc[k / sub] * (q[k] - offset) + dmin * mn[k / sub]
// with q unsigned; formats without sub-block scales have sc = mn = 1, formats without a minimum
// dmin = 0. K-quants store dmin positive and subtract it: here it carries its sign.
#pragma once

#include "common.h"

namespace powerinfer {

struct BlockFormat {
  GgmlType type;
  int64_t n;        // weights per block: QK or QK_K
  int64_t bytes;    // bytes per block in the file
  int64_t sub;      // weights per sub-block scale (n where there is one scale per block)
  int q_bits;       // bits of q
  int offset;       // subtracted from q
  bool sub_scales;  // integer scales per sub-block (K-quants)
  bool has_min;     // a dmin * mn term
  constexpr int64_t n_sub() const { return n / sub; }
};

//                                      type           n     bytes sub   bits off  sub_scales has_min
inline constexpr BlockFormat BLOCK_FORMATS[] = {{GgmlType::Q4_0, QK, 18, QK, 4, 8, false, false},
                                                {GgmlType::Q4_1, QK, 20, QK, 4, 0, false, true},
                                                {GgmlType::Q5_0, QK, 22, QK, 5, 16, false, false},
                                                {GgmlType::Q5_1, QK, 24, QK, 5, 0, false, true},
                                                {GgmlType::Q8_0, QK, 34, QK, 8, 128, false, false},  // q: int8 + 128
                                                {GgmlType::Q2_K, QK_K, 84, 16, 2, 0, true, true},
                                                {GgmlType::Q3_K, QK_K, 110, 16, 3, 4, true, false},
                                                {GgmlType::Q4_K, QK_K, 144, 32, 4, 0, true, true},
                                                {GgmlType::Q5_K, QK_K, 176, 32, 5, 0, true, true},
                                                {GgmlType::Q6_K, QK_K, 210, 16, 6, 32, true, false}};

constexpr const BlockFormat* find_format(int64_t type) {
  for (const BlockFormat& f : BLOCK_FORMATS)
    if (static_cast<int64_t>(f.type) == type) return &f;
  return nullptr;
}

// The format of a GGML type id; throws std::invalid_argument for a type we do not keep in blocks.
const BlockFormat& block_format(int64_t type);

struct BlockScales {
  int8_t sc[QK_K / QK_SUB];  // per sub-block
  uint8_t mn[QK_K / QK_SUB];
  uint16_t d, dmin;  // float16 bits, dmin with the sign it is applied with (0 without a minimum)
};

struct DecodedBlock : BlockScales {
  uint8_t q[QK_K];
};

void decode_scales(const BlockFormat& f, const uint8_t* block, BlockScales& out);
void decode_block(const BlockFormat& f, const uint8_t* block, DecodedBlock& out);

}  // namespace powerinfer
