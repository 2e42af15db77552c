// The AVX2 kernel of SparseInputProjection (sparse_input.h). Chunk by chunk of outputs, and within a
// chunk per active block of 32 inputs:
//   4-bit forms: the int16 sums of the chunk's outputs (of every row of the group) stay in L1 while
//   the active channels' pieces of run stream past, four channels (two pairs) at a time (each group
//   fetching the next group's pieces ahead, GroupRuns); a pair's nibbles interleaved byte by byte,
//   `_mm256_maddubs_epi16` by a row's [k_j, k_j+1]
//   byte pairs sums both channels' products for 16 outputs.
//   Q8: the same, eight channels at a time, with int32 sums: both channels' bytes of a pair
//   sign-extended to int16 and interleaved meet a row's [k_j, k_j+1] in one `_mm256_madd_epi16`.
// Then the sums meet the block's scales once per output: the Q4 form's in integers (`madd` by its scale
// bytes, which its layout keeps in the sums' order), as floats times the row's scale into the
// super-block's sums, which its float16 D multiplies once (SuperBlockSums); the other forms' as
// floats, into the rows' float sums of the chunk.
// Measured on the 7B shapes (AMD EPYC Zen 3, 2 threads, one row, from memory, a block's four linears
// Q4_0): channels one pair per pass over the sums ran at 0.70x the dense kernel with nothing skipped,
// 1.04x at 40 %, 1.17x at 50 %; two pairs per pass 0.95x, 1.32-1.39x, 1.54-1.59x; four pairs alike
// at one row, slower for groups of rows. A register-step kernel (all of a block's active runs per 64
// outputs, sums in registers) ran at 0.6x with nothing skipped, and Q8 that way at 0.47x on a
// 262k-output head.
#include "sparse_input.h"

#include "quant_matmul.h"

#ifdef POWERINFER_X86
#include <immintrin.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "avx2_lanes.h"

// Where a group's fetches ahead go (GroupRuns::fetch): lines fetched into L1 a group's pass ahead
// (4-16 KB a pass) must outlive that pass there beside the 16 KB of sums, and a 32 KB L1 does not keep
// them; the loads then find them in L2 if they were fetched there. Measured, 2 threads, a 7B block's
// four linears from memory, 50 % skipped, L2 against L1: an AMD EPYC Zen 4 (32 KB L1, AVX2 only) one
// row 1.15x (Q4_0), 1.11x (Q4_K), 1.13x (Q6_K), 1.22x (Q8_0), four rows of Q4_0 1.04x; on an AMD
// EPYC Zen 5 (48 KB L1, AVX-512) L1 was the faster (common.h's prefetch_line). Unknown size: L1.
// (Set at load time outside the AVX2 code, which a CPU without AVX2 must not run.)
namespace powerinfer {
namespace {
const bool FETCH_TO_L1 = [] {
  const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
  return l1 <= 0 || l1 >= 48 * 1024;
}();
}  // namespace
}  // namespace powerinfer

POWERINFER_TARGET_AVX2
namespace powerinfer::avx2 {
namespace {

// y[0..16) += the 16 int32 sums of lo and hi (8 each) times their d (d_lo, d_hi) times scale.
inline void add_scaled(float* y, __m256i lo, __m256i hi, __m256 d_lo, __m256 d_hi, __m256 scale) {
  _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(scale, d_lo), _mm256_loadu_ps(y)));
  _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(scale, d_hi), _mm256_loadu_ps(y + 8)));
}

// y[0..16) += (m + 8 d) * rounded_sum, d and m as float32 (lo, hi: 8 outputs each): the minimum term of
// the forms with one, for what the centred sums left out.
inline void add_minimum(float* y, __m256 d_lo, __m256 d_hi, __m256 m_lo, __m256 m_hi, __m256 rounded_sum) {
  const __m256 eight = _mm256_set1_ps(8.0f);
  _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_fmadd_ps(eight, d_lo, m_lo), rounded_sum, _mm256_loadu_ps(y)));
  _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_fmadd_ps(eight, d_hi, m_hi), rounded_sum, _mm256_loadu_ps(y + 8)));
}

// 8 bytes at p (Q4, Q6: signed, Q4_K: unsigned) as float32.
inline __m256 bytes_as_floats(const RunLayout& l, const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(l.form == RunForm::Q4_K ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes));
}

// The d (at d_at) or m (at m_at) of 8 outputs from `at` of a block of 4-bit runs: float16, or the
// byte there times the table's float16 (byte_scales).
inline __m256 q4_scale(const RunLayout& l, const uint8_t* at, const uint8_t* table_at) {
  return l.byte_scales() ? _mm256_mul_ps(halves(table_at), bytes_as_floats(l, at)) : halves(at);
}

// Sums of the 4-bit kernel, all rows of a chunk: 16 KB of int16, in L1 while each active channel's
// piece of run (4 KB with one row: a page, the least that skipping saves whole) streams past (a whole
// run per chunk, its sums in L2, measured alike).
constexpr int64_t Q4_SUMS = 8192;

// The Q8 kernel's chunk: up to Q8_CHUNK outputs (pieces of 8 KB: measured faster than 4 KB on a
// 262k-output head, 1 and 4 rows), their int32 sums of all rows at most Q8_SUMS (64 KB, in L2).
constexpr int64_t Q8_CHUNK = 8192, Q8_SUMS = 16384;

// Channels per pass over the sums: the sums are loaded and stored once per group. 4-bit runs take
// two pairs (their k stay in registers; four pairs spilled them, slower for groups of rows); Q8 runs
// four pairs (measured on a 262k-output Q8 head, 4 rows: 1.2x two pairs' speed; eight pairs spilled
// the weights, 0.6x).
constexpr int Q4_GROUP = 4, Q8_GROUP = 8;

// The pieces of channels [j, j + G) of a block's runs that a group reads for outputs [c0, c0 + n)
// (past j1, channel j's: its k is 0 there).
template <int G>
struct GroupRuns {
  const uint8_t* w[G];
  int64_t bytes = 0;  // of each piece (0: no group)

  GroupRuns() = default;
  GroupRuns(const RunLayout& l, const uint8_t* block, const Selection& s, int32_t j, int32_t j1, int64_t c0, int64_t n)
      : bytes(l.run_byte(n)) {
    for (int p = 0; p < G; ++p) w[p] = block + l.run_at(s.channel[j + p < j1 ? j + p : j]) + l.run_byte(c0);
  }
  // Fetches the pieces' line at byte `at` into L1 or L2 (FETCH_TO_L1). A group fetches the next group's pieces (after
  // its last, the next piece kernel's first) at the byte it reads itself: every run of a block starts a
  // stream of its own a piece long (4-8 KB), which the hardware prefetchers learn too late (measured on
  // an AMD EPYC with AVX-512, 2 threads, one row, 50 % skipped, ratio to the dense kernel: 4096 ->
  // 12288 Q4_0 1.31x -> 1.51x, 11008 -> 4096 1.21x -> 1.53x; two groups ahead 1.44x, 1.33x).
  void fetch(int64_t at) const {
    if (at % 64 != 0 || at >= bytes) return;
    for (int p = 0; p < G; ++p)
      if (FETCH_TO_L1)
        prefetch_line<CacheLevel::L1>(w[p] + at);
      else
        prefetch_line<CacheLevel::L2>(w[p] + at);
  }
  // The lines that start in bytes [from, to) (Q6 reads 96 bytes a step).
  void fetch_span(int64_t from, int64_t to) const {
    for (int64_t at = (from + 63) / 64 * 64; at < to; at += 64) fetch(at);
  }
};

// The group of channels [j, j + G) of a block that a piece kernel reads, and the group it fetches
// meanwhile: the block's next, or after its last `after`, the next piece's first.
template <int G>
struct GroupAndNext {
  GroupRuns<G> here, next;
};

template <int G>
GroupAndNext<G> group_and_next(const RunLayout& l, const uint8_t* block, const Selection& s, int32_t j, int32_t j1,
                               int64_t c0, int64_t n, const GroupRuns<G>& after) {
  return {GroupRuns<G>(l, block, s, j, j1, c0, n), j + G < j1 ? GroupRuns<G>(l, block, s, j + G, j1, c0, n) : after};
}

// Fetches the scales (d, and m where the form has them; the bytes and, given a table, its D, and M, of
// the forms with byte_scales) of outputs [o, o + n) of a block into the cache: the last group of a
// piece fetches those its outputs' sums meet next (the table only on a super-block's last block, the
// one that reads it: fetching it on every block measured 2-3 % slower on the 7B-width Q4_0 files).
inline void fetch_scales(const RunLayout& l, const uint8_t* block, const uint8_t* table, int64_t o, int64_t n) {
  const int64_t bytes = l.byte_scales() ? n : 2 * n;
  for (int64_t sub = 0; sub < l.sub_blocks(); ++sub) prefetch(block + l.d_at(o, sub), bytes);
  if (l.has_min()) prefetch(block + l.m_at(o), bytes);
  if (!table) return;
  if (l.byte_scales()) prefetch(table + l.table_d_at(o), 2 * n);
  if (l.form == RunForm::Q4_K) prefetch(table + l.table_m_at(o), 2 * n);
}

// What a piece kernel reads of block i of the selection for outputs [c0, c0 + chunk): the block's
// bytes, its table (table_of), its active channels [j0, j1), the R rows' scales and k sums, and how many
// outputs it covers.
struct BlockPiece {
  const uint8_t *block, *table;
  int32_t j0, j1;
  const float* scale;
  const int32_t* k_sum;
  int64_t n;
};

template <int R>
inline BlockPiece piece_of(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i, int64_t c0,
                           int64_t chunk) {
  return {runs + s.blocks[i] * l.block_bytes(), table_of(l, runs, s.blocks[i]), s.start[i], s.start[i + 1],
          &s.scale[i * R], &s.k_sum[i * R], std::min(chunk, l.padded - c0)};
}

// A copy of `l` whose form the compiler knows: a piece kernel made for one form then folds its tests
// of the form (has_min, byte_scales, d_at...) away instead of branching on them per 16 outputs.
template <RunForm F>
inline RunLayout with_form(const RunLayout& l) {
  RunLayout fixed = l;
  fixed.form = F;
  return fixed;
}

// Row r's k of channel c, 0 past j1.
inline int8_t k_of(const Selection& s, int32_t c, int32_t j1, int r) { return c < j1 ? s.k[c * s.rows + r] : 0; }

// Row r's [k_c, k_c+1] as two int16 in one int32 (Q8 runs, for madd), 0 past j1.
inline int32_t wide_pair(const Selection& s, int32_t c, int32_t j1, int r) {
  return static_cast<int32_t>(static_cast<uint16_t>(k_of(s, c, j1, r)) |
                              static_cast<uint32_t>(static_cast<uint16_t>(k_of(s, c + 1, j1, r))) << 16);
}

// Row r's [k_c, k_c+1] as two bytes in one int16 (4-bit runs, for maddubs), 0 past j1.
inline int16_t byte_pair(const Selection& s, int32_t c, int32_t j1, int r) {
  return static_cast<int16_t>(static_cast<uint8_t>(k_of(s, c, j1, r)) | static_cast<uint8_t>(k_of(s, c + 1, j1, r)) << 8);
}

// Per pair of the group [j, j + G) and per row, [k_j, k_j+1] broadcast: as two bytes (4-bit runs,
// for maddubs) or, WIDE, as two int16 (Q8 runs, for madd).
template <int G, int R, bool WIDE>
inline void pair_ks(const Selection& s, int32_t j, int32_t j1, __m256i k[G / 2][R]) {
  for (int h = 0; h < G / 2; ++h)
    for (int r = 0; r < R; ++r) {
      if constexpr (WIDE)
        k[h][r] = _mm256_set1_epi32(wide_pair(s, j + 2 * h, j1, r));
      else
        k[h][r] = _mm256_set1_epi16(byte_pair(s, j + 2 * h, j1, r));
    }
}

// The sums of 32 outputs from their two int16 vectors (lo, hi: the unpacked halves, slot order
// [0 16 1 17 2 18 3 19 | 8 24 ... 11 27] and [4 20 ... 7 23 | 12 28 ... 15 31]) as four int32
// vectors of 8 outputs in order.
inline void in_order(__m256i lo, __m256i hi, __m256i q[4]) {
  const __m256i lo_even = _mm256_srai_epi32(_mm256_slli_epi32(lo, 16), 16), lo_odd = _mm256_srai_epi32(lo, 16);
  const __m256i hi_even = _mm256_srai_epi32(_mm256_slli_epi32(hi, 16), 16), hi_odd = _mm256_srai_epi32(hi, 16);
  q[0] = _mm256_permute2x128_si256(lo_even, hi_even, 0x20);
  q[1] = _mm256_permute2x128_si256(lo_even, hi_even, 0x31);
  q[2] = _mm256_permute2x128_si256(lo_odd, hi_odd, 0x20);
  q[3] = _mm256_permute2x128_si256(lo_odd, hi_odd, 0x31);
}

// A 4-bit run's vector as its low and its high nibbles.
inline void split_nibbles(__m256i v, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
}

// A Q6 run's 64 outputs, their nibbles v and their 16 bytes of top bits at p, as the 6-bit values at
// the nibbles' low places (lo) and high places (hi): the top bits broadcast to both lanes and shifted
// per 64-bit lane to bits 4 and 5 of the byte they line up with (q6_slots: the low places' from bits
// 0-1, 2-3 by lane, the high places' from 4-5, 6-7), masked, joined to the nibbles.
inline void split_six_bits(__m256i v, const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i x = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i top = _mm256_set1_epi8(0x30);
  split_nibbles(v, lo, hi);
  lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_sllv_epi64(x, _mm256_setr_epi64x(4, 4, 2, 2)), top));
  hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srlv_epi64(x, _mm256_setr_epi64x(0, 0, 2, 2)), top));
}

// Two channels' values (at the nibbles' low places a, high places b) interleaved byte by byte, channel
// j's first: the four vectors that `maddubs` meets with a row's [k_j, k_j+1].
inline void interleave(__m256i a0, __m256i b0, __m256i a1, __m256i b1, __m256i out[4]) {
  out[0] = _mm256_unpacklo_epi8(a0, a1), out[1] = _mm256_unpackhi_epi8(a0, a1);
  out[2] = _mm256_unpacklo_epi8(b0, b1), out[3] = _mm256_unpackhi_epi8(b0, b1);
}

// sums[u] += two pairs' products with a row's k pairs k0, k1 (u = 0..3).
inline void add_two_pairs(int16_t* sums, const __m256i pair0[4], const __m256i pair1[4], __m256i k0, __m256i k1) {
  __m256i* a = reinterpret_cast<__m256i*>(sums);
  for (int u = 0; u < 4; ++u)
    a[u] = _mm256_add_epi16(a[u], _mm256_add_epi16(_mm256_maddubs_epi16(pair0[u], k0), _mm256_maddubs_epi16(pair1[u], k1)));
}

// Q4_MIN (the one 4-bit form with float16 d and m per output and block, so not summed per
// super-block): y[o .. o + 32) += a row's 4-bit sums of those outputs (the int16 vectors at lo, hi:
// slot order, see in_order) times the block's d and the row's scale, plus the minimum term.
inline void add_q4_min_outputs(const RunLayout& l, const uint8_t* block, int64_t o, const int16_t* lo, const int16_t* hi,
                               float scale, int32_t k_sum, float* y) {
  const __m256 row_scale = _mm256_set1_ps(scale);
  __m256i q[4];
  in_order(_mm256_load_si256(reinterpret_cast<const __m256i*>(lo)), _mm256_load_si256(reinterpret_cast<const __m256i*>(hi)), q);
  __m256 d[4], m[4];
  for (int h = 0; h < 4; ++h) d[h] = halves(block + l.d_at(o + 8 * h)), m[h] = halves(block + l.m_at(o + 8 * h));
  add_scaled(y + o, q[0], q[1], d[0], d[1], row_scale);
  add_scaled(y + o + 16, q[2], q[3], d[2], d[3], row_scale);
  const __m256 rounded_sum = _mm256_set1_ps(scale * static_cast<float>(k_sum));
  add_minimum(y + o, d[0], d[1], m[0], m[1], rounded_sum);
  add_minimum(y + o + 16, d[2], d[3], m[2], m[3], rounded_sum);
}

// Where a piece's block lies in its super-block (QK_K inputs), and the float sums the forms with byte
// scales (Q4, Q4_K, Q6) gather over the super-block (per row `padded` outputs, kept between the pieces of
// a call; Q4_K's minimums' apart): each block adds its int16 sums times its scale bytes, in integers,
// times the row's scale, and the super-block's float16 D (and M) multiply them once, after its last
// block. (Before, every block converted D and its bytes to floats for every output: with nothing in
// the way of the memory, that step took about 40 % of a Q4_0 linear's time.)
struct SuperBlockSums {
  float *sums, *min_sums;  // null where the form has no byte scales (no minimums)
  bool first, last;

  // The super-block's table for fetch_scales to fetch ahead: only on its last block, the one that reads it.
  const uint8_t* table_to_fetch(const uint8_t* table) const { return last ? table : nullptr; }
};

// What one block adds to a row's super-block sums: its int16 sums, its scale bytes, the row's scale
// and (Q4_K) its k sum in the block (Q6's rounds: add_q6_round).
struct BlockTerms {
  const int16_t* sums;
  const uint8_t* scales;
  float scale;
  int32_t k_sum;
};

// The even and the odd int16 lanes of each int32 lane: a vector of scales so masked, `madd` by a
// vector of int16 sums, gives the products of the even (or odd) lanes as int32.
inline __m256i even_lanes(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)); }
inline __m256i odd_lanes(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))); }

// into = (first ? 0 : into) + v * scale, 8 floats.
inline void add_scaled_floats(float* into, __m256i v, __m256 scale, bool first) {
  const __m256 f = _mm256_cvtepi32_ps(v);
  _mm256_storeu_ps(into, first ? _mm256_mul_ps(f, scale) : _mm256_fmadd_ps(f, scale, _mm256_loadu_ps(into)));
}

// A block's terms for n outputs (slot order, per 64 four vectors of 16 sums; its bytes the same order:
// q4_scale_slot) into a row's super-block sums (on its first block, in place of them): per 64 outputs
// and vector u, 8 floats of the even lanes, 8 of the odd. The integers: sc times the sums (Q4_K: times
// the sums + 8 k_sum, the sums being centred on 8). Q4_K's minimums: add_minimums; Q6's sums:
// add_q6_round.
template <RunForm F>
inline void add_to_super_block(const BlockTerms& t, int64_t n, bool first, float* into) {
  const __m256 row_scale = _mm256_set1_ps(t.scale);
  const __m256i eight_k_sum = _mm256_set1_epi16(static_cast<int16_t>(8 * t.k_sum));
  for (int64_t g = 0; g < n; g += 64)
    for (int u = 0; u < 4; ++u) {
      const int64_t at = g + 16 * u;
      const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.scales + at)));
      const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(t.sums + at));
      __m256i even = _mm256_madd_epi16(s, even_lanes(sc)), odd = _mm256_madd_epi16(s, odd_lanes(sc));
      if constexpr (F == RunForm::Q4_K) {
        even = _mm256_add_epi32(even, _mm256_madd_epi16(even_lanes(sc), eight_k_sum));
        odd = _mm256_add_epi32(odd, _mm256_madd_epi16(odd_lanes(sc), eight_k_sum));
      }
      add_scaled_floats(into + at, even, row_scale, first);
      add_scaled_floats(into + at + 8, odd, row_scale, first);
    }
}

// Q4_K's minimums of a block (n outputs from the bytes at `mins`) into R rows' minimum sums (rows
// `stride` apart; in place of them where `first`), in add_to_super_block's order: per 16 outputs 8
// floats of the even lanes, 8 of the odd. The bytes become floats once for all rows, each row adding
// them times its scale times its k sum in the block (its rounded x's sum).
template <int R>
inline void add_minimums(const uint8_t* mins, const float* scale, const int32_t* k_sum, int64_t n, bool first,
                         float* min_sums, int64_t stride) {
  __m256 x_sum[R];
  for (int r = 0; r < R; ++r) x_sum[r] = _mm256_set1_ps(scale[r] * static_cast<float>(k_sum[r]));
  for (int64_t at = 0; at < n; at += 16) {
    const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + at)));
    const __m256 lanes[2] = {_mm256_cvtepi32_ps(even_lanes(mn)), _mm256_cvtepi32_ps(_mm256_srli_epi32(mn, 16))};
    for (int r = 0; r < R; ++r) {
      if (!first && scale[r] == 0.0f) continue;  // nothing of this row in the block
      for (int h = 0; h < 2; ++h) {
        float* into = min_sums + r * stride + at + 8 * h;
        _mm256_storeu_ps(into, first ? _mm256_mul_ps(lanes[h], x_sum[r]) : _mm256_fmadd_ps(lanes[h], x_sum[r], _mm256_loadu_ps(into)));
      }
    }
  }
}

// 8 floats' worth of one of a super-block's sums, per 32 outputs: the even and the odd lanes of its
// two vectors of 16 into output order (as in_order): outputs 0-7, 8-15, 16-23, 24-31.
inline void super_sums_in_order(const float* a, __m256 q[4]) {
  const __m256 lo_even = _mm256_loadu_ps(a), lo_odd = _mm256_loadu_ps(a + 8);
  const __m256 hi_even = _mm256_loadu_ps(a + 16), hi_odd = _mm256_loadu_ps(a + 24);
  q[0] = _mm256_permute2f128_ps(lo_even, hi_even, 0x20), q[1] = _mm256_permute2f128_ps(lo_even, hi_even, 0x31);
  q[2] = _mm256_permute2f128_ps(lo_odd, hi_odd, 0x20), q[3] = _mm256_permute2f128_ps(lo_odd, hi_odd, 0x31);
}

// y[c0 .. c0 + n) += a row's super-block sums of those outputs times its D (and, Q4_K, its minimums'
// sums times M).
template <RunForm F>
inline void add_super_block(const RunLayout& l, const uint8_t* table, int64_t c0, int64_t n, const float* sums,
                            const float* min_sums, float* y) {
  for (int64_t g = 0; g < n; g += 32) {
    __m256 q[4], m[4];
    super_sums_in_order(sums + g, q);
    if constexpr (F == RunForm::Q4_K) super_sums_in_order(min_sums + g, m);
    for (int h = 0; h < 4; ++h) {
      const int64_t o = c0 + g + 8 * h;
      __m256 sum = _mm256_fmadd_ps(q[h], halves(table + l.table_d_at(o)), _mm256_loadu_ps(y + o));
      if constexpr (F == RunForm::Q4_K) sum = _mm256_fmadd_ps(m[h], halves(table + l.table_m_at(o)), sum);
      _mm256_storeu_ps(y + o, sum);
    }
  }
}

// The 4-bit forms with byte scales, a piece's R rows: each row's block terms into its super-block's
// sums (in place of them where `fresh`), and Q4_K's minimums into theirs. ADD and MINIMUMS: an
// instruction set's add_to_super_block and add_minimums (Q4_K) for the form.
template <RunForm F, int R, auto ADD, auto MINIMUMS = nullptr>
void rows_into_super_block(const RunLayout& l, const BlockPiece& p, int64_t c0, int64_t chunk, const int16_t* acc,
                           bool fresh, const SuperBlockSums& super) {
  for (int r = 0; r < R; ++r)
    if (fresh || p.scale[r] != 0.0f)  // 0: nothing of this row in the block
      ADD({acc + r * chunk, p.block + l.d_at(c0), p.scale[r], p.k_sum[r]}, p.n, fresh, super.sums + r * l.padded + c0);
  if constexpr (F == RunForm::Q4_K) MINIMUMS(p.block + l.m_at(c0), p.scale, p.k_sum, p.n, fresh, super.min_sums + c0, l.padded);
}

// After a super-block's last block, its R rows' sums into y. FLUSH: an instruction set's
// add_super_block for the form.
template <int R, auto FLUSH>
void rows_from_super_block(const RunLayout& l, const BlockPiece& p, int64_t c0, const SuperBlockSums& super, float* y) {
  for (int r = 0; r < R; ++r)
    FLUSH(l, p.table, c0, p.n, super.sums + r * l.padded + c0, super.min_sums ? super.min_sums + r * l.padded + c0 : nullptr,
          y + r * l.padded);
}

// 4-bit runs, R rows, outputs [c0, c0 + chunk) of block i. Channels go Q4_GROUP at a time, in pairs:
// a pair's nibbles interleaved byte by byte (channel j, channel j + 1 for the same output), so that
// one `_mm256_maddubs_epi16` by the byte pairs [k_j, k_j+1] of a row sums both channels' products for
// 16 outputs; the unpacking is shared by the rows. acc: per row the chunk's int16 sums, in slot order
// (see in_order).
template <int R, RunForm F>
void add_q4_piece(const RunLayout& layout, const uint8_t* runs, const Selection& s, int64_t i, int64_t c0, int64_t chunk,
                  const GroupRuns<Q4_GROUP>& after, float* y, int16_t* acc, const SuperBlockSums& super) {
  const RunLayout l = with_form<F>(layout);
  const BlockPiece piece = piece_of<R>(l, runs, s, i, c0, chunk);
  const auto [block, table, j0, j1, scale, k_sum, n] = piece;
  for (int r = 0; r < R; ++r) {
    const __m256i init = _mm256_set1_epi16(static_cast<int16_t>(-8 * k_sum[r]));  // wraps: the sums fit int16
    for (int64_t o = 0; o < n; o += 16) _mm256_store_si256(reinterpret_cast<__m256i*>(acc + r * chunk + o), init);
  }
  for (int32_t j = j0; j < j1; j += Q4_GROUP) {
    const auto [here, next] = group_and_next<Q4_GROUP>(l, block, s, j, j1, c0, n, after);
    const uint8_t* const* w = here.w;
    __m256i k[Q4_GROUP / 2][R];
    pair_ks<Q4_GROUP, R, false>(s, j, j1, k);
    for (int64_t g = 0; g < n; g += 64) {
      next.fetch(g / 2);
      if (j + Q4_GROUP >= j1) fetch_scales(l, block, super.table_to_fetch(table), c0 + g, 64);
      __m256i both[Q4_GROUP / 2][4];
      for (int h = 0; h < Q4_GROUP / 2; ++h) {
        __m256i lo0, hi0, lo1, hi1;
        split_nibbles(_mm256_load_si256(reinterpret_cast<const __m256i*>(w[2 * h] + g / 2)), lo0, hi0);
        split_nibbles(_mm256_load_si256(reinterpret_cast<const __m256i*>(w[2 * h + 1] + g / 2)), lo1, hi1);
        interleave(lo0, hi0, lo1, hi1, both[h]);
      }
      for (int r = 0; r < R; ++r) add_two_pairs(acc + r * chunk + g, both[0], both[1], k[0][r], k[1][r]);
    }
  }
  if constexpr (F == RunForm::Q4_MIN) {
    for (int r = 0; r < R; ++r) {
      if (scale[r] == 0.0f) continue;  // nothing of this row in the block
      for (int64_t g = 0; g < n; g += 32)
        add_q4_min_outputs(l, block, c0 + g, acc + r * chunk + g, acc + r * chunk + g + 16, scale[r], k_sum[r], y + r * l.padded);
    }
  } else {
    rows_into_super_block<F, R, add_to_super_block<F>, add_minimums<R>>(l, piece, c0, chunk, acc, super.first, super);
    if (super.last) rows_from_super_block<R, add_super_block<F>>(l, piece, c0, super, y);
  }
}

// The first of a Q6 piece's active channels [j0, j1) in its second sub-block (j1: none).
inline int32_t q6_second_sub_block(const RunLayout& l, const Selection& s, int32_t j0, int32_t j1) {
  int32_t mid = j0;
  while (mid < j1 && l.sub_block(s.channel[mid]) == 0) ++mid;
  return mid;
}

// Where a set of Q6 sums over channels [a, b) starts for row r: -q_offset times the row's k sum
// there, so that the set ends at the sum of k (q - q_offset).
inline int16_t q6_sums_start(const RunLayout& l, const Selection& s, int32_t a, int32_t b, int r) {
  int32_t sum = 0;
  for (int32_t j = a; j < b; ++j) sum += s.k[j * s.rows + r];
  return static_cast<int16_t>(-l.q_offset() * sum);
}

// Q6 sums (see add_q6_piece): a set of int16 sums holds one sub-block's active channels [a, b).
struct Q6Set {
  int32_t a, b;
  int sub;
};

// The sets of a Q6 piece's active channels [j0, j1) in the order the kernel takes them: a round per
// set of each sub-block, the first round's set of a sub-block its longest leading run of whole groups
// whose k every row sums exactly in int16 (32 times the sum of |k| at most 32767, as |q - 32| <= 32),
// the second round's the rest, at most eight channels (eight |k| of at most 127 fit). At the
// sparsities that pay, the kept x are each block's larger ones, yet a sub-block's sixteen rarely
// reach the bound: one round, one step into the super-block's sums per block. Where the rows'
// largest sum decides a split, the rounds' products with the scale bytes add up in int32 before any
// float: a row's result then does not depend on where the split falls, so not on its group's
// other rows (Q6Round).
struct Q6Plan {
  std::array<Q6Set, 4> sets;
  int count = 0, first_round = 0;  // sets in all, in the first round
};

inline Q6Plan q6_plan(const RunLayout& l, const Selection& s, int32_t j0, int32_t j1) {
  constexpr int32_t EXACT = 32767 / 32;
  const int32_t bounds[3] = {j0, q6_second_sub_block(l, s, j0, j1), j1};
  int32_t split[2];
  for (int sub = 0; sub < 2; ++sub) {
    const int32_t a = bounds[sub], b = bounds[sub + 1];
    std::array<int32_t, MAX_GROUP_ROWS> total{};
    split[sub] = b;
    for (int32_t j = a; j < b && split[sub] == b; j += Q4_GROUP)
      for (int r = 0; r < s.rows; ++r) {
        for (int32_t c = j; c < std::min(j + Q4_GROUP, b); ++c) total[r] += std::abs(s.k[c * s.rows + r]);
        if (total[r] > EXACT) split[sub] = j;
      }
  }
  Q6Plan plan;
  for (int sub = 0; sub < 2; ++sub)
    if (bounds[sub] < split[sub]) plan.sets[plan.count++] = {bounds[sub], split[sub], sub};
  plan.first_round = plan.count;
  for (int sub = 0; sub < 2; ++sub)
    if (split[sub] < bounds[sub + 1]) plan.sets[plan.count++] = {split[sub], bounds[sub + 1], sub};
  return plan;
}

// What a round of a Q6 block does with its int32 products: ALONE (the block's only round) and LAST add
// them (LAST: with those HELD by the round before) into the super-block's float sums; HELD keeps them,
// as int32, in `held`.
enum class Q6Round { ALONE, HELD, LAST };

// A round of a Q6 block's sums (per row, sub-block `sub`'s at acc + (sub R + r) chunk where has[sub])
// times their sub-blocks' scale bytes, in integers, both sub-blocks' into one int32 vector, into R
// rows' super-block sums (`sums`: the chunk's; in place of them where `first`), or held (Q6Round;
// `held`: per row the chunk's int32 products); the scale bytes become int16 lanes once for all rows.
template <int R>
inline void add_q6_round(const RunLayout& l, const BlockPiece& p, int64_t c0, int64_t chunk, const int16_t* acc,
                         const bool has[2], Q6Round kind, bool first, float* sums, int32_t* held) {
  __m256 row_scale[R];
  for (int r = 0; r < R; ++r) row_scale[r] = _mm256_set1_ps(p.scale[r]);
  for (int64_t at = 0; at < p.n; at += 16) {
    __m256i even_sc[2], odd_sc[2];
    for (int sub = 0; sub < 2; ++sub) {
      const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.block + l.d_at(c0, sub) + at)));
      even_sc[sub] = even_lanes(sc), odd_sc[sub] = odd_lanes(sc);
    }
    for (int r = 0; r < R; ++r) {
      if (!first && p.scale[r] == 0.0f) continue;  // nothing of this row in the block
      __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
      for (int sub = 0; sub < 2; ++sub) {
        if (!has[sub]) continue;
        const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(acc + (sub * R + r) * chunk + at));
        even = _mm256_add_epi32(even, _mm256_madd_epi16(s, even_sc[sub]));
        odd = _mm256_add_epi32(odd, _mm256_madd_epi16(s, odd_sc[sub]));
      }
      __m256i* kept = reinterpret_cast<__m256i*>(held + r * chunk + at);
      if (kind == Q6Round::HELD) {
        _mm256_store_si256(kept, even), _mm256_store_si256(kept + 1, odd);
        continue;
      }
      if (kind == Q6Round::LAST)
        even = _mm256_add_epi32(even, _mm256_load_si256(kept)), odd = _mm256_add_epi32(odd, _mm256_load_si256(kept + 1));
      add_scaled_floats(sums + r * l.padded + at, even, row_scale[r], first);
      add_scaled_floats(sums + r * l.padded + at + 8, odd, row_scale[r], first);
    }
  }
}

// Q6 runs, R rows, outputs [c0, c0 + chunk) of block i, as the 4-bit kernel: each channel's nibbles
// and top two bits (each 64 outputs' 16 bytes broadcast to both lanes, shifted and masked to line up
// byte by byte with the nibbles: q6_slots) joined into its 6-bit q, which meets the rows' k pairs in
// `maddubs` (a pair's products at most 2 * 63 * 127: no saturation). Each sub-block's channels into
// their own int16 sums (acc: per row sub-block 0's, then per row sub-block 1's), from -32 times the
// channels' k sum, so that they end at the sum of k (q - 32), exact while q6_plan's bound holds; after
// a round (q6_plan) both sub-blocks' sums meet their scale bytes in one step into the super-block's
// sums. (Summing the nibbles and the top bits apart took two multiply-adds per row: four rows ran at
// 0.70x the dense rows against 0.79-0.95x with Q6_K re-quantized to Q8 runs. Sets of at most eight
// channels, each sub-block stepping into the super-block's sums apart: four rows at 0.52-0.55x the
// dense rows on an AVX2-only AMD EPYC, 7B widths, 0-70 % skipped.)
// This drives an instruction set's parts: SET_SUMS (one set's channels into its rows' sums, fetching
// `then` ahead), ROUND (add_q6_round) and FLUSH (add_super_block).
using Q6SetSums = void (*)(const RunLayout& l, const BlockPiece& p, const Selection& s, int32_t a, int32_t b, int64_t c0,
                           int64_t chunk, const GroupRuns<Q4_GROUP>& then, const SuperBlockSums& super, int16_t* sums);

template <int R, Q6SetSums SET_SUMS, auto ROUND, auto FLUSH>
void add_q6_piece(const RunLayout& layout, const uint8_t* runs, const Selection& s, int64_t i, int64_t c0, int64_t chunk,
                  const GroupRuns<Q4_GROUP>& after, float* y, int16_t* acc, const SuperBlockSums& super) {
  const RunLayout l = with_form<RunForm::Q6>(layout);
  const BlockPiece piece = piece_of<R>(l, runs, s, i, c0, chunk);
  const Q6Plan plan = q6_plan(l, s, piece.j0, piece.j1);
  const bool split = plan.count > plan.first_round;  // two rounds
  alignas(64) int32_t held[Q4_SUMS / 2];             // per row its first round's products (Q6Round::HELD)
  bool has[2] = {false, false};                      // the sub-blocks with sums in this round
  for (int e = 0; e < plan.count; ++e) {
    const auto [a, b, sub] = plan.sets[e];
    const GroupRuns<Q4_GROUP> then =
        e + 1 < plan.count ? GroupRuns<Q4_GROUP>(l, piece.block, s, plan.sets[e + 1].a, plan.sets[e + 1].b, c0, piece.n) : after;
    SET_SUMS(l, piece, s, a, b, c0, chunk, then, super, acc + sub * R * chunk);
    has[sub] = true;
    if (e + 1 == plan.first_round || e + 1 == plan.count) {
      const Q6Round kind = !split ? Q6Round::ALONE : e + 1 == plan.count ? Q6Round::LAST : Q6Round::HELD;
      ROUND(l, piece, c0, chunk, acc, has, kind, super.first, super.sums + c0, held);
      has[0] = has[1] = false;
    }
  }
  if (super.last) rows_from_super_block<R, FLUSH>(l, piece, c0, super, y);
}

// One set's channels [a, b) of a Q6 piece into its R rows' int16 sums (per row `chunk` apart).
template <int R>
void q6_set_sums(const RunLayout& l, const BlockPiece& p, const Selection& s, int32_t a, int32_t b, int64_t c0,
                 int64_t chunk, const GroupRuns<Q4_GROUP>& then, const SuperBlockSums& super, int16_t* sums) {
  for (int r = 0; r < R; ++r) {
    const __m256i start = _mm256_set1_epi16(q6_sums_start(l, s, a, b, r));
    for (int64_t o = 0; o < p.n; o += 16) _mm256_store_si256(reinterpret_cast<__m256i*>(sums + r * chunk + o), start);
  }
  for (int32_t j = a; j < b; j += Q4_GROUP) {
    const auto [here, next] = group_and_next<Q4_GROUP>(l, p.block, s, j, b, c0, p.n, then);
    const uint8_t* const* w = here.w;
    __m256i k[Q4_GROUP / 2][R];
    pair_ks<Q4_GROUP, R, false>(s, j, b, k);
    for (int64_t g = 0; g < p.n; g += 64) {
      if (g % 128 == 0) next.fetch_span(l.run_byte(g), l.run_byte(g + 128));
      if (j + Q4_GROUP >= b) fetch_scales(l, p.block, super.table_to_fetch(p.table), c0 + g, 64);
      __m256i six[Q4_GROUP / 2][4];
      for (int h = 0; h < Q4_GROUP / 2; ++h) {
        const uint8_t *w0 = w[2 * h], *w1 = w[2 * h + 1];
        __m256i lo0, hi0, lo1, hi1;
        split_six_bits(_mm256_load_si256(reinterpret_cast<const __m256i*>(w0 + q6_nibbles_at(g))), w0 + q6_top_at(g), lo0, hi0);
        split_six_bits(_mm256_load_si256(reinterpret_cast<const __m256i*>(w1 + q6_nibbles_at(g))), w1 + q6_top_at(g), lo1, hi1);
        interleave(lo0, hi0, lo1, hi1, six[h]);
      }
      for (int r = 0; r < R; ++r) add_two_pairs(sums + r * chunk + g, six[0], six[1], k[0][r], k[1][r]);
    }
  }
}

// The sums of 16 outputs from the two int32 vectors of the Q8 kernel (slot order [0 8 1 9 | 4 12 5 13]
// and [2 10 3 11 | 6 14 7 15]) as outputs 0-7 and 8-15.
inline void q8_in_order(__m256i a, __m256i b, __m256i& first, __m256i& second) {
  a = _mm256_shuffle_epi32(a, 0xD8);  // [0 1 8 9 | 4 5 12 13]
  b = _mm256_shuffle_epi32(b, 0xD8);  // [2 3 10 11 | 6 7 14 15]
  first = _mm256_unpacklo_epi64(a, b);
  second = _mm256_unpackhi_epi64(a, b);
}

// Q8 runs, R rows, outputs [c0, c0 + chunk) of block i, as the 4-bit kernel: channels Q8_GROUP at a
// time stream past the rows' int32 sums; each 16 outputs of a pair of channels, sign-extended to int16
// and interleaved (channel j, channel j + 1 for the same output), meet a row's [k_j, k_j+1] pairs in
// one `_mm256_madd_epi16`. acc: per row the chunk's sums, in slot order (see q8_in_order).
// VNNI: AVX-VNNI's vpdpwssd does each madd and its add in one instruction (the same int32 sums).
template <int R, bool VNNI = false>
void add_q8_piece(const RunLayout& layout, const uint8_t* runs, const Selection& s, int64_t i, int64_t c0, int64_t chunk,
                  const GroupRuns<Q8_GROUP>& after, float* y, int32_t* acc) {
  constexpr int P = Q8_GROUP / 2;
  const RunLayout l = with_form<RunForm::Q8>(layout);
  const auto [block, table, j0, j1, scale, k_sum, n] = piece_of<R>(l, runs, s, i, c0, chunk);
  std::fill(acc, acc + R * chunk, 0);
  for (int32_t j = j0; j < j1; j += Q8_GROUP) {
    const auto [here, next] = group_and_next<Q8_GROUP>(l, block, s, j, j1, c0, n, after);
    const uint8_t* const* w = here.w;
    alignas(32) __m256i k[P][R];
    pair_ks<Q8_GROUP, R, true>(s, j, j1, k);
    for (int64_t g = 0; g < n; g += 16) {
      next.fetch(g);
      if (j + Q8_GROUP >= j1 && g % 32 == 0) fetch_scales(l, block, table, c0 + g, 32);
      __m256i lo[P], hi[P];
      for (int h = 0; h < P; ++h) {
        const __m256i v0 = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(w[2 * h] + g)));
        const __m256i v1 = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(w[2 * h + 1] + g)));
        lo[h] = _mm256_unpacklo_epi16(v0, v1), hi[h] = _mm256_unpackhi_epi16(v0, v1);
      }
      for (int r = 0; r < R; ++r) {
        __m256i* a = reinterpret_cast<__m256i*>(acc + r * chunk + g);
        __m256i sum_lo = a[0], sum_hi = a[1];
        for (int h = 0; h < P; ++h) {
          sum_lo = add_pair_products<VNNI>(sum_lo, lo[h], k[h][r]);
          sum_hi = add_pair_products<VNNI>(sum_hi, hi[h], k[h][r]);
        }
        a[0] = sum_lo, a[1] = sum_hi;
      }
    }
  }
  for (int64_t g = 0; g < n; g += 16) {
    const __m256 d0 = halves(block + l.d_at(c0 + g)), d1 = halves(block + l.d_at(c0 + g + 8));  // once for all rows
    for (int r = 0; r < R; ++r) {
      if (scale[r] == 0.0f) continue;  // nothing of this row in the block
      __m256i first, second;
      q8_in_order(_mm256_load_si256(reinterpret_cast<const __m256i*>(acc + r * chunk + g)),
                  _mm256_load_si256(reinterpret_cast<const __m256i*>(acc + r * chunk + g + 8)), first, second);
      add_scaled(y + r * l.padded + c0 + g, first, second, d0, d1, _mm256_set1_ps(scale[r]));
    }
  }
}

// The low nibbles of a step (4 channels: their values at the nibbles' low places lo[c] and high places
// hi[c], bytes) of 64 outputs into the step's 32 bytes of each output block's chunk, at[0..3]
// (quant_matmul.h's 4-bit step: output o's pair t at byte 2 slot(o) + t, channel 2t + i in nibble i).
// A run's even bytes hold outputs j, its odd ones 16 + j at the low places (32 + j, 48 + j at the high
// ones: q4_slot); the pairs' bytes joined as 16-bit words, even and odd apart, are the output blocks'
// words in output order, and slot order swaps their middle quarters.
inline void put_low_step(const __m256i lo[4], const __m256i hi[4], uint8_t* const at[4]) {
  const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(static_cast<char>(0xF0));
  const __m256i even = _mm256_set1_epi16(0x00FF), odd = _mm256_set1_epi16(static_cast<int16_t>(0xFF00));
  for (int h = 0; h < 2; ++h) {
    const __m256i* v = h ? hi : lo;
    const __m256i p0 = _mm256_or_si256(_mm256_and_si256(v[0], low), _mm256_and_si256(_mm256_slli_epi16(v[1], 4), high));
    const __m256i p1 = _mm256_or_si256(_mm256_and_si256(v[2], low), _mm256_and_si256(_mm256_slli_epi16(v[3], 4), high));
    const __m256i e = _mm256_or_si256(_mm256_and_si256(p0, even), _mm256_slli_epi16(p1, 8));
    const __m256i o = _mm256_or_si256(_mm256_srli_epi16(p0, 8), _mm256_and_si256(p1, odd));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at[2 * h]), _mm256_permute4x64_epi64(e, SLOT_QUARTERS));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at[2 * h + 1]), _mm256_permute4x64_epi64(o, SLOT_QUARTERS));
  }
}

// Q6: the top two bits of a group of four steps (16 channels' values, as put_low_step's) into the
// group's two planes of each output block's chunk (at[nb], plane t at + 32: byte 2 slot(o) + i holds
// channel 4u + 2t + i's bits at 2u).
inline void put_high_group(const __m256i lo[16], const __m256i hi[16], uint8_t* const at[4]) {
  const __m256i three = _mm256_set1_epi8(3);
  const __m256i even = _mm256_set1_epi16(0x00FF), odd = _mm256_set1_epi16(static_cast<int16_t>(0xFF00));
  for (int h = 0; h < 2; ++h) {
    const __m256i* v = h ? hi : lo;
    for (int t = 0; t < 2; ++t) {
      __m256i pair[2];
      for (int i = 0; i < 2; ++i) {
        pair[i] = _mm256_setzero_si256();
        for (int u = 0; u < 4; ++u)
          pair[i] = _mm256_or_si256(pair[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v[4 * u + 2 * t + i], 4), three), 2 * u));
      }
      const __m256i e = _mm256_or_si256(_mm256_and_si256(pair[0], even), _mm256_slli_epi16(pair[1], 8));
      const __m256i o = _mm256_or_si256(_mm256_srli_epi16(pair[0], 8), _mm256_and_si256(pair[1], odd));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at[2 * h] + 2 * COLS * t), _mm256_permute4x64_epi64(e, SLOT_QUARTERS));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at[2 * h + 1] + 2 * COLS * t), _mm256_permute4x64_epi64(o, SLOT_QUARTERS));
    }
  }
}

// Q8: a pair of channels' bytes (runs a, b: each 16 outputs' 16 bytes, output j at byte 2j, 8 + j at
// 2j + 1: q8_slot) of 64 outputs into the pair's 32 bytes of each output block's chunk (output o's two
// at 2o, 2o + 1).
inline void put_q8_pair(const uint8_t* a, const uint8_t* b, uint8_t* const at[4]) {
  const __m256i even = _mm256_set1_epi16(0x00FF), odd = _mm256_set1_epi16(static_cast<int16_t>(0xFF00));
  for (int w = 0; w < 2; ++w) {
    const __m256i ra = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * w));
    const __m256i rb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * w));
    const __m256i e = _mm256_or_si256(_mm256_and_si256(ra, even), _mm256_slli_epi16(rb, 8));  // outputs j
    const __m256i o = _mm256_or_si256(_mm256_srli_epi16(ra, 8), _mm256_and_si256(rb, odd));   // outputs 8 + j
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at[2 * w]), _mm256_permute2x128_si256(e, o, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at[2 * w + 1]), _mm256_permute2x128_si256(e, o, 0x31));
  }
}

// Blocks of runs that repack_runs fetches ahead.
constexpr int64_t REPACK_AHEAD = 4;

// The 64 outputs' bytes of a block's byte scales (q4_scale_slot order) in output order: outputs
// 16v + t (v = 2 half + p) lie in vector u = 2 half + (t / 4) % 2 of 16 bytes, at byte 2j + p
// (j = t % 4 + 4 (t / 8)), so each 16 outputs are two shuffles of two vectors.
inline void scale_bytes_in_order(const uint8_t* bytes, uint8_t in_order[64]) {
  alignas(16) static constexpr auto masks = [] {  // [p][of vector u even, odd][t]
    std::array<std::array<std::array<uint8_t, 16>, 2>, 2> m{};
    for (int p = 0; p < 2; ++p)
      for (int t = 0; t < 16; ++t)
        for (int odd = 0; odd < 2; ++odd)
          m[p][odd][t] = (t / 4) % 2 == odd ? static_cast<uint8_t>(2 * (t % 4 + 4 * (t / 8)) + p) : 0x80;
    return m;
  }();
  for (int v = 0; v < 4; ++v) {
    const int half = v / 2, p = v % 2;
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 32 * half));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 32 * half + 16));
    const __m128i even = _mm_load_si128(reinterpret_cast<const __m128i*>(masks[p][0].data()));
    const __m128i odd = _mm_load_si128(reinterpret_cast<const __m128i*>(masks[p][1].data()));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(in_order + 16 * v), _mm_or_si128(_mm_shuffle_epi8(a, even), _mm_shuffle_epi8(b, odd)));
  }
}

// The scales of run block b for outputs [g, g + 64) into the four output blocks' chunks at chunk[nb]
// (of b's file block).
void put_scales(const RunLayout& l, const PackedLayout& p, const uint8_t* runs, int64_t b, int64_t g, uint8_t* const chunk[4]) {
  const uint8_t* block = runs + b * l.block_bytes();
  const uint8_t* table = table_of(l, runs, b);
  const int64_t sub = b % RunLayout::BLOCKS_PER_SUPER;  // K-quants: the sub-block of the file block
  alignas(16) uint8_t in_order[64];
  for (int64_t nb = 0; nb < 4; ++nb) {
    const int64_t o = g + nb * COLS;
    switch (l.form) {
      case RunForm::Q4_MIN:
        std::memcpy(chunk[nb] + p.dmin, block + l.m_at(o), 2 * COLS);
        [[fallthrough]];
      case RunForm::Q8: std::memcpy(chunk[nb] + p.d, block + l.d_at(o), 2 * COLS); break;
      case RunForm::Q4_K:
        std::memcpy(chunk[nb] + p.dmin, table + l.table_m_at(o), 2 * COLS);
        [[fallthrough]];
      case RunForm::Q6: std::memcpy(chunk[nb] + p.d, table + l.table_d_at(o), 2 * COLS); break;
      case RunForm::Q4: break;
    }
  }
  if (l.form == RunForm::Q4) {  // d = D sc in float16
    scale_bytes_in_order(block + l.d_at(g), in_order);
    for (int r = 0; r < 8; ++r) {
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in_order + 8 * r))));
      const __m256 d = _mm256_mul_ps(halves(table + l.table_d_at(g + 8 * r)), sc);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk[r / 2] + p.d + 16 * (r % 2)), _mm256_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT));
    }
  }
  for (int64_t h = 0; l.byte_scales() && l.form != RunForm::Q4 && h < l.sub_blocks(); ++h) {  // the file's own bytes
    scale_bytes_in_order(block + l.d_at(g, h), in_order);
    for (int64_t nb = 0; nb < 4; ++nb) std::memcpy(chunk[nb] + p.sc + (sub * l.sub_blocks() + h) * COLS, in_order + nb * COLS, COLS);
  }
  if (l.form == RunForm::Q4_K) {
    scale_bytes_in_order(block + l.m_at(g), in_order);
    for (int64_t nb = 0; nb < 4; ++nb) std::memcpy(chunk[nb] + p.mn + sub * COLS, in_order + nb * COLS, COLS);
  }
}

}  // namespace

void repack_runs(const RunLayout& l, const uint8_t* runs, int64_t g, uint8_t* chunks) {
  const BlockFormat& f = block_format(static_cast<int64_t>(packed_type(l.form)));
  const PackedLayout p = packed_layout(f);
  const int64_t per_row = l.in_features / f.n, per_file_block = f.n / QK;
  // where the 64 outputs lie in a run (Q6: its nibbles; its top bits lie in the same cache line or the next)
  const int64_t in_run = l.form == RunForm::Q8 ? g : l.form == RunForm::Q6 ? q6_nibbles_at(g) : g / 2;
  for (int64_t b = 0; b < l.blocks(); ++b) {
    const uint8_t* block = runs + b * l.block_bytes();
    if (b + REPACK_AHEAD < l.blocks()) {  // a strided read: fetched ahead, as no prefetcher follows it
      const uint8_t* ahead = block + REPACK_AHEAD * l.block_bytes();
      for (int64_t c = 0; c < QK; ++c) prefetch_line<CacheLevel::L1>(ahead + l.run_at(c) + in_run);
      fetch_scales(l, ahead, table_of(l, runs, b + REPACK_AHEAD), g, 64);
    }
    uint8_t* chunk[4];  // b's file block in each output block
    for (int64_t nb = 0; nb < 4; ++nb) chunk[nb] = chunks + (nb * per_row + b / per_file_block) * p.bytes;
    put_scales(l, p, runs, b, g, chunk);
    if (l.form == RunForm::Q8) {
      for (int64_t pair = 0; pair < QK / 2; ++pair) {
        uint8_t* at[4];
        for (int64_t nb = 0; nb < 4; ++nb) at[nb] = chunk[nb] + p.low + pair * 2 * COLS;
        put_q8_pair(block + l.run_at(2 * pair) + in_run, block + l.run_at(2 * pair + 1) + in_run, at);
      }
      continue;
    }
    const int64_t first_step = b % per_file_block * (QK / STEP);  // of b's 8 steps within its file block
    for (int64_t q = 0; q < QK; q += 16) {  // four steps: a group of Q6's top bits
      __m256i lo[16], hi[16];
      for (int64_t c = 0; c < 16; ++c) {
        const uint8_t* run = block + l.run_at(q + c);
        const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + in_run));
        if (l.form == RunForm::Q6)
          split_six_bits(nibbles, run + q6_top_at(g), lo[c], hi[c]);
        else
          split_nibbles(nibbles, lo[c], hi[c]);
      }
      const int64_t step = first_step + q / STEP;
      for (int u = 0; u < 4; ++u) {
        uint8_t* at[4];
        for (int64_t nb = 0; nb < 4; ++nb) at[nb] = chunk[nb] + p.low + (step + u) * 2 * COLS;
        put_low_step(lo + 4 * u, hi + 4 * u, at);
      }
      if (l.form == RunForm::Q6) {
        uint8_t* at[4];
        for (int64_t nb = 0; nb < 4; ++nb) at[nb] = chunk[nb] + high_plane(p, step, 0);
        put_high_group(lo, hi, at);
      }
    }
  }
}

namespace {

// Q8 (the heads): chunk by chunk of outputs, and within a chunk block by block, so that the rows' float
// sums of a chunk stay in cache while every block adds to them (block by block over all outputs, a
// 262k-output head's float sums, 1 MB a row, go to memory and back once per block: measured 1.15-1.25x
// slower with four rows, alike with one).
// Piece: the kernel of one block's runs for one chunk of outputs (this file's AVX2 one, or AVX-512's).
// after: the next piece's first group of runs, for the piece to fetch ahead.
using Q8Piece = void (*)(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i, int64_t c0,
                         int64_t chunk, const GroupRuns<Q8_GROUP>& after, float* y, int32_t* acc);

// The first group of runs of block i's piece for outputs [c0, c0 + chunk), or none (bytes 0) where
// the range is empty.
template <int G>
GroupRuns<G> first_group(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i, int64_t i1, int64_t c0,
                         int64_t chunk) {
  if (i >= i1 || c0 >= l.padded) return {};
  return {l, runs + s.blocks[i] * l.block_bytes(), s, s.start[i], s.start[i + 1], c0, std::min(chunk, l.padded - c0)};
}

template <int R, Q8Piece piece = add_q8_piece<R>>
void add_q8_blocks(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1, float* y) {
  alignas(64) int32_t acc[Q8_SUMS];
  constexpr int64_t chunk = std::min<int64_t>(Q8_CHUNK, Q8_SUMS / R / RUN_GROUP * RUN_GROUP);
  for (int64_t c0 = 0; c0 < l.padded; c0 += chunk)
    for (int64_t i = i0; i < i1; ++i) {
      const auto after = i + 1 < i1 ? first_group<Q8_GROUP>(l, runs, s, i + 1, i1, c0, chunk)
                                    : first_group<Q8_GROUP>(l, runs, s, i0, i1, c0 + chunk, chunk);
      piece(l, runs, s, i, c0, chunk, after, y, acc);
    }
}

// 4-bit: block by block, each block's runs chunk after chunk, so that a run's pieces are read in
// order (chunk by chunk over the blocks, each piece a new stream: measured 1.1-1.3x slower on a
// 4096 -> 22016 Q4_0 linear, one row, 40-50 % skipped).
using Q4Piece = void (*)(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i, int64_t c0,
                         int64_t chunk, const GroupRuns<Q4_GROUP>& after, float* y, int16_t* acc,
                         const SuperBlockSums& super);

// PLANES: sets of int16 sums per output and row (Q6: two, see add_q6_piece).
template <int R, Q4Piece piece, int PLANES = 1>
void add_q4_blocks(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1, float* y) {
  alignas(64) int16_t acc[Q4_SUMS];
  constexpr int64_t chunk = Q4_SUMS / (PLANES * R) / RUN_GROUP * RUN_GROUP;
  thread_local std::vector<float> super_sums;  // kept between calls: no fresh pages per call
  const int64_t sets = l.byte_scales() ? (l.has_min() ? 2 : 1) : 0;  // the sums, and Q4_K's minimums'
  if (super_sums.size() < static_cast<size_t>(sets * R * l.padded)) super_sums.resize(sets * R * l.padded);
  float* const sums = sets ? super_sums.data() : nullptr;
  float* const min_sums = sets == 2 ? sums + R * l.padded : nullptr;
  const auto super_block = [&](int64_t i) { return l.super_block(s.blocks[i]); };
  for (int64_t i = i0; i < i1; ++i) {
    const SuperBlockSums super{sums, min_sums, i == i0 || super_block(i - 1) != super_block(i),
                               i + 1 == i1 || super_block(i + 1) != super_block(i)};
    for (int64_t c0 = 0; c0 < l.padded; c0 += chunk) {
      const auto after = c0 + chunk < l.padded ? first_group<Q4_GROUP>(l, runs, s, i, i1, c0 + chunk, chunk)
                                               : first_group<Q4_GROUP>(l, runs, s, i + 1, i1, 0, chunk);
      piece(l, runs, s, i, c0, chunk, after, y, acc, super);
    }
  }
}

}  // namespace

// R rows' blocks with the form's kernel (Q8 with AVX-VNNI where it is on).
template <int R>
void add_form_blocks(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1, float* y) {
  switch (l.form) {
    case RunForm::Q4: return add_q4_blocks<R, add_q4_piece<R, RunForm::Q4>>(l, runs, s, i0, i1, y);
    case RunForm::Q4_MIN: return add_q4_blocks<R, add_q4_piece<R, RunForm::Q4_MIN>>(l, runs, s, i0, i1, y);
    case RunForm::Q4_K: return add_q4_blocks<R, add_q4_piece<R, RunForm::Q4_K>>(l, runs, s, i0, i1, y);
    case RunForm::Q6:
      return add_q4_blocks<R, add_q6_piece<R, q6_set_sums<R>, add_q6_round<R>, add_super_block<RunForm::Q6>>, 2>(l, runs, s, i0, i1, y);
    case RunForm::Q8:
      if (avx_vnni_active()) return add_q8_blocks<R, add_q8_piece<R, true>>(l, runs, s, i0, i1, y);
      return add_q8_blocks<R>(l, runs, s, i0, i1, y);
  }
}

void add_runs(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1, float* y) {
  static_assert(GROUP_ROWS == 4, "one kernel per group size");
  switch (s.rows) {
    case 1: return add_form_blocks<1>(l, runs, s, i0, i1, y);
    case 2: return add_form_blocks<2>(l, runs, s, i0, i1, y);
    case 3: return add_form_blocks<3>(l, runs, s, i0, i1, y);
    default: return add_form_blocks<4>(l, runs, s, i0, i1, y);
  }
}

}  // namespace powerinfer::avx2
POWERINFER_TARGET_END

// The AVX-512 kernels: the AVX2 kernels' order of work (avx2::add_q4_blocks, add_q8_blocks) and
// helpers, twice the outputs per instruction; Q8 runs with VNNI's `_mm512_dpwssd_epi32` doing a pair's
// multiply-add and the sum in one instruction.
POWERINFER_TARGET_AVX512
namespace powerinfer::avx512 {
namespace {

// 16 float16 at p as floats.
inline __m512 sixteen_halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// Of the four int16 vectors of 128 outputs' 4-bit sums at `sums` (see add_q4_piece), vectors u and
// u + 1 (u = 0 or 2) as int32 sums of outputs u * 16 + [0, 16), [16, 32), [64, 80), [80, 96).
// Vector u holds, per 128-bit lane, int16 pairs of outputs (e, e + 16): lane 0 e = 0..3 (u = 0), 4..7
// (u = 1), lane 1 8..11, 12..15, lanes 2 and 3 the same + 64; u = 2, 3 the same + 32. Their even
// and odd halves as int32, vectors u = 0 and 1 side by side, give outputs 0-15 and 64-79 (even), 16-31 and
// 80-95 (odd); u = 2, 3 the same + 32.
inline void sums_in_order(const int16_t* sums, int u, __m512i in_order[4]) {
  const __m512i low_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i high_half = _mm512_add_epi32(low_half, _mm512_set1_epi32(8));
  const __m512i a = _mm512_load_si512(sums + 32 * u), b = _mm512_load_si512(sums + 32 * u + 32);
  const __m512i even_a = _mm512_srai_epi32(_mm512_slli_epi32(a, 16), 16), odd_a = _mm512_srai_epi32(a, 16);
  const __m512i even_b = _mm512_srai_epi32(_mm512_slli_epi32(b, 16), 16), odd_b = _mm512_srai_epi32(b, 16);
  in_order[0] = _mm512_permutex2var_epi32(even_a, low_half, even_b);   // + 0
  in_order[1] = _mm512_permutex2var_epi32(odd_a, low_half, odd_b);     // + 16
  in_order[2] = _mm512_permutex2var_epi32(even_a, high_half, even_b);  // + 64
  in_order[3] = _mm512_permutex2var_epi32(odd_a, high_half, odd_b);    // + 80
}

// As avx2's split_nibbles, split_six_bits, interleave and add_two_pairs, 128 outputs at a time
// (split_six_bits: the 32 bytes of top bits at p of 128 outputs, as [first 16, first 16, next 16,
// next 16] by 128-bit lane).
inline void split_nibbles(__m512i v, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
}

inline void split_six_bits(__m512i v, const uint8_t* p, __m512i& lo, __m512i& hi) {
  const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i x = _mm512_shuffle_i64x2(both, both, 0x50);  // lanes 0 0 1 1
  const __m512i top = _mm512_set1_epi8(0x30);
  split_nibbles(v, lo, hi);
  lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_sllv_epi64(x, _mm512_setr_epi64(4, 4, 2, 2, 4, 4, 2, 2)), top));
  hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srlv_epi64(x, _mm512_setr_epi64(0, 0, 2, 2, 0, 0, 2, 2)), top));
}

inline void interleave(__m512i a0, __m512i b0, __m512i a1, __m512i b1, __m512i out[4]) {
  out[0] = _mm512_unpacklo_epi8(a0, a1), out[1] = _mm512_unpackhi_epi8(a0, a1);
  out[2] = _mm512_unpacklo_epi8(b0, b1), out[3] = _mm512_unpackhi_epi8(b0, b1);
}

inline void add_two_pairs(int16_t* sums, const __m512i pair0[4], const __m512i pair1[4], __m512i k0, __m512i k1) {
  for (int u = 0; u < 4; ++u)
    _mm512_store_si512(sums + 32 * u, _mm512_add_epi16(_mm512_load_si512(sums + 32 * u),
                                                       _mm512_add_epi16(_mm512_maddubs_epi16(pair0[u], k0),
                                                                        _mm512_maddubs_epi16(pair1[u], k1))));
}

// The first output of sums_in_order's vector v of pair u, from o.
inline int64_t in_order_output(int64_t o, int u, int v) { return o + 16 * u + 16 * (v % 2) + 64 * (v / 2); }

// As avx2::add_q4_min_outputs, 128 outputs (the four int16 vectors at `sums`, see add_q4_piece).
inline void add_q4_min_outputs(const RunLayout& l, const uint8_t* block, int64_t o, const int16_t* sums, float scale,
                               int32_t k_sum, float* y) {
  const __m512 row_scale = _mm512_set1_ps(scale);
  const __m512 rounded_sum = _mm512_set1_ps(scale * static_cast<float>(k_sum));
  const __m512 eight = _mm512_set1_ps(8.0f);
  for (int u = 0; u < 4; u += 2) {
    __m512i in_order[4];
    sums_in_order(sums, u, in_order);
    for (int v = 0; v < 4; ++v) {
      const int64_t at = in_order_output(o, u, v);
      const __m512 d = sixteen_halves(block + l.d_at(at)), m = sixteen_halves(block + l.m_at(at));
      const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(in_order[v]), _mm512_mul_ps(row_scale, d), _mm512_loadu_ps(y + at));
      _mm512_storeu_ps(y + at, _mm512_fmadd_ps(_mm512_fmadd_ps(eight, d, m), rounded_sum, sum));
    }
  }
}

// into = (first ? 0 : into) + v * scale, 16 floats.
inline void add_scaled_floats(float* into, __m512i v, __m512 scale, bool first) {
  const __m512 f = _mm512_cvtepi32_ps(v);
  _mm512_storeu_ps(into, first ? _mm512_mul_ps(f, scale) : _mm512_fmadd_ps(f, scale, _mm512_loadu_ps(into)));
}

// A vector of sums' 32 byte scales (at p and p + 64: see add_to_super_block) as int16.
inline __m512i vector_bytes(const uint8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + 64), reinterpret_cast<const __m128i*>(p)));
}

// As avx2::add_to_super_block, 128 outputs a step: vector v of the sums holds the AVX2 kernel's vector v
// of the first 64 outputs and of the next 64, so its bytes are those two vectors' 16 each.
template <RunForm F>
inline void add_to_super_block(const avx2::BlockTerms& t, int64_t n, bool first, float* into) {
  const __m512i even_lanes = _mm512_set1_epi32(0xFFFF), odd_lanes = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512 row_scale = _mm512_set1_ps(t.scale);
  const __m512i eight_k_sum = _mm512_set1_epi16(static_cast<int16_t>(8 * t.k_sum));
  for (int64_t g = 0; g < n; g += 128)
    for (int v = 0; v < 4; ++v) {
      const int64_t at = g + 32 * v;
      const __m512i sc = vector_bytes(t.scales + g + 16 * v);
      const __m512i sc_even = _mm512_and_si512(sc, even_lanes), sc_odd = _mm512_and_si512(sc, odd_lanes);
      const __m512i s = _mm512_load_si512(t.sums + at);
      __m512i even = _mm512_madd_epi16(s, sc_even), odd = _mm512_madd_epi16(s, sc_odd);
      if constexpr (F == RunForm::Q4_K) {
        even = _mm512_add_epi32(even, _mm512_madd_epi16(sc_even, eight_k_sum));
        odd = _mm512_add_epi32(odd, _mm512_madd_epi16(sc_odd, eight_k_sum));
      }
      add_scaled_floats(into + at, even, row_scale, first);
      add_scaled_floats(into + at + 16, odd, row_scale, first);
    }
}

// As avx2::add_minimums, 128 outputs a step (add_to_super_block's order: vector v's bytes at 16 v and
// 64 + 16 v, its even lanes' floats, then its odd lanes').
template <int R>
inline void add_minimums(const uint8_t* mins, const float* scale, const int32_t* k_sum, int64_t n, bool first,
                         float* min_sums, int64_t stride) {
  __m512 x_sum[R];
  for (int r = 0; r < R; ++r) x_sum[r] = _mm512_set1_ps(scale[r] * static_cast<float>(k_sum[r]));
  for (int64_t g = 0; g < n; g += 128)
    for (int v = 0; v < 4; ++v) {
      const int64_t at = g + 32 * v;
      const __m512i mn = vector_bytes(mins + g + 16 * v);
      const __m512 lanes[2] = {_mm512_cvtepi32_ps(_mm512_and_si512(mn, _mm512_set1_epi32(0xFFFF))),
                               _mm512_cvtepi32_ps(_mm512_srli_epi32(mn, 16))};
      for (int r = 0; r < R; ++r) {
        if (!first && scale[r] == 0.0f) continue;  // nothing of this row in the block
        for (int h = 0; h < 2; ++h) {
          float* into = min_sums + r * stride + at + 16 * h;
          _mm512_storeu_ps(into, first ? _mm512_mul_ps(lanes[h], x_sum[r]) : _mm512_fmadd_ps(lanes[h], x_sum[r], _mm512_loadu_ps(into)));
        }
      }
    }
}

// One of a super-block's sums for 128 outputs from g (add_to_super_block's order) in output order, as
// sums_in_order does: for u = 0 or 2, outputs 16 u + [0, 16), [16, 32), [64, 80), [80, 96).
inline void super_sums_in_order(const float* a, int u, __m512 in_order[4]) {
  const __m512i low_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i high_half = _mm512_add_epi32(low_half, _mm512_set1_epi32(8));
  a += 32 * u;  // vector u: even lanes, odd lanes; then vector u + 1
  const __m512 even_a = _mm512_loadu_ps(a), odd_a = _mm512_loadu_ps(a + 16);
  const __m512 even_b = _mm512_loadu_ps(a + 32), odd_b = _mm512_loadu_ps(a + 48);
  in_order[0] = _mm512_permutex2var_ps(even_a, low_half, even_b), in_order[1] = _mm512_permutex2var_ps(odd_a, low_half, odd_b);
  in_order[2] = _mm512_permutex2var_ps(even_a, high_half, even_b), in_order[3] = _mm512_permutex2var_ps(odd_a, high_half, odd_b);
}

// As avx2::add_super_block, 128 outputs a step.
template <RunForm F>
inline void add_super_block(const RunLayout& l, const uint8_t* table, int64_t c0, int64_t n, const float* sums,
                            const float* min_sums, float* y) {
  for (int64_t g = 0; g < n; g += 128)
    for (int u = 0; u < 4; u += 2) {
      __m512 q[4], m[4];
      super_sums_in_order(sums + g, u, q);
      if constexpr (F == RunForm::Q4_K) super_sums_in_order(min_sums + g, u, m);
      for (int v = 0; v < 4; ++v) {
        const int64_t at = in_order_output(c0 + g, u, v);
        __m512 sum = _mm512_fmadd_ps(q[v], sixteen_halves(table + l.table_d_at(at)), _mm512_loadu_ps(y + at));
        if constexpr (F == RunForm::Q4_K) sum = _mm512_fmadd_ps(m[v], sixteen_halves(table + l.table_m_at(at)), sum);
        _mm512_storeu_ps(y + at, sum);
      }
    }
}

// 4-bit runs, R rows, outputs [c0, c0 + chunk) of block i (see avx2::add_q4_piece): 128 outputs per
// step, each 256-bit half of a vector what the AVX2 kernel computes for 64 of them. acc: per row and
// 128 outputs, the AVX2 kernel's four int16 vectors of the first 64 (a0..a3) and of the next 64 (b0..b3)
// stored as a0 b0 a1 b1 a2 b2 a3 b3.
template <int R, RunForm F>
void add_q4_piece(const RunLayout& layout, const uint8_t* runs, const Selection& s, int64_t i, int64_t c0, int64_t chunk,
                  const avx2::GroupRuns<avx2::Q4_GROUP>& after, float* y, int16_t* acc, const avx2::SuperBlockSums& super) {
  using namespace avx2;
  const RunLayout l = with_form<F>(layout);
  const BlockPiece piece = piece_of<R>(l, runs, s, i, c0, chunk);
  const auto [block, table, j0, j1, scale, k_sum, n] = piece;
  for (int r = 0; r < R; ++r) {
    const __m512i init = _mm512_set1_epi16(static_cast<int16_t>(-8 * k_sum[r]));  // wraps: the sums fit int16
    for (int64_t o = 0; o < n; o += 32) _mm512_store_si512(acc + r * chunk + o, init);
  }
  for (int32_t j = j0; j < j1; j += Q4_GROUP) {
    const auto [here, next] = group_and_next<Q4_GROUP>(l, block, s, j, j1, c0, n, after);
    const uint8_t* const* w = here.w;
    __m512i k[Q4_GROUP / 2][R];
    for (int h = 0; h < Q4_GROUP / 2; ++h)
      for (int r = 0; r < R; ++r) k[h][r] = _mm512_set1_epi16(byte_pair(s, j + 2 * h, j1, r));
    for (int64_t g = 0; g < n; g += 128) {
      next.fetch(g / 2);
      if (j + Q4_GROUP >= j1) fetch_scales(l, block, super.table_to_fetch(table), c0 + g, 128);
      __m512i both[Q4_GROUP / 2][4];
      for (int h = 0; h < Q4_GROUP / 2; ++h) {
        __m512i lo0, hi0, lo1, hi1;
        split_nibbles(_mm512_loadu_si512(w[2 * h] + g / 2), lo0, hi0);
        split_nibbles(_mm512_loadu_si512(w[2 * h + 1] + g / 2), lo1, hi1);
        interleave(lo0, hi0, lo1, hi1, both[h]);
      }
      for (int r = 0; r < R; ++r) add_two_pairs(acc + r * chunk + g, both[0], both[1], k[0][r], k[1][r]);
    }
  }
  if constexpr (F == RunForm::Q4_MIN) {
    for (int r = 0; r < R; ++r) {
      if (scale[r] == 0.0f) continue;  // nothing of this row in the block
      for (int64_t g = 0; g < n; g += 128)
        add_q4_min_outputs(l, block, c0 + g, acc + r * chunk + g, scale[r], k_sum[r], y + r * l.padded);
    }
  } else {
    rows_into_super_block<F, R, add_to_super_block<F>, add_minimums<R>>(l, piece, c0, chunk, acc, super.first, super);
    if (super.last) rows_from_super_block<R, add_super_block<F>>(l, piece, c0, super, y);
  }
}

// As avx2::add_q6_round, 128 outputs a step (add_to_super_block's order).
template <int R>
inline void add_q6_round(const RunLayout& l, const avx2::BlockPiece& p, int64_t c0, int64_t chunk, const int16_t* acc,
                         const bool has[2], avx2::Q6Round kind, bool first, float* sums, int32_t* held) {
  using avx2::Q6Round;
  const __m512i even_lanes = _mm512_set1_epi32(0xFFFF), odd_lanes = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 row_scale[R];
  for (int r = 0; r < R; ++r) row_scale[r] = _mm512_set1_ps(p.scale[r]);
  for (int64_t g = 0; g < p.n; g += 128)
    for (int v = 0; v < 4; ++v) {
      const int64_t at = g + 32 * v;
      __m512i even_sc[2], odd_sc[2];
      for (int sub = 0; sub < 2; ++sub) {
        const __m512i sc = vector_bytes(p.block + l.d_at(c0, sub) + g + 16 * v);
        even_sc[sub] = _mm512_and_si512(sc, even_lanes), odd_sc[sub] = _mm512_and_si512(sc, odd_lanes);
      }
      for (int r = 0; r < R; ++r) {
        if (!first && p.scale[r] == 0.0f) continue;  // nothing of this row in the block
        __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
        for (int sub = 0; sub < 2; ++sub) {
          if (!has[sub]) continue;
          const __m512i s = _mm512_load_si512(acc + (sub * R + r) * chunk + at);
          even = _mm512_add_epi32(even, _mm512_madd_epi16(s, even_sc[sub]));
          odd = _mm512_add_epi32(odd, _mm512_madd_epi16(s, odd_sc[sub]));
        }
        int32_t* kept = held + r * chunk + at;
        if (kind == Q6Round::HELD) {
          _mm512_store_si512(kept, even), _mm512_store_si512(kept + 16, odd);
          continue;
        }
        if (kind == Q6Round::LAST)
          even = _mm512_add_epi32(even, _mm512_load_si512(kept)), odd = _mm512_add_epi32(odd, _mm512_load_si512(kept + 16));
        add_scaled_floats(sums + r * l.padded + at, even, row_scale[r], first);
        add_scaled_floats(sums + r * l.padded + at + 16, odd, row_scale[r], first);
      }
    }
}

// As avx2::q6_set_sums, 128 outputs per step, each 256-bit half of a vector what the AVX2 kernel
// computes for 64 of them (the top bits' 32 bytes as [first 16, first 16, next 16, next 16] by 128-bit
// lane); the sums as add_q4_piece's.
template <int R>
void q6_set_sums(const RunLayout& l, const avx2::BlockPiece& p, const Selection& s, int32_t a, int32_t b, int64_t c0,
                 int64_t chunk, const avx2::GroupRuns<avx2::Q4_GROUP>& then, const avx2::SuperBlockSums& super,
                 int16_t* sums) {
  using namespace avx2;
  for (int r = 0; r < R; ++r) {
    const __m512i start = _mm512_set1_epi16(q6_sums_start(l, s, a, b, r));
    for (int64_t o = 0; o < p.n; o += 32) _mm512_store_si512(sums + r * chunk + o, start);
  }
  for (int32_t j = a; j < b; j += Q4_GROUP) {
    const auto [here, next] = group_and_next<Q4_GROUP>(l, p.block, s, j, b, c0, p.n, then);
    const uint8_t* const* w = here.w;
    __m512i k[Q4_GROUP / 2][R];
    for (int h = 0; h < Q4_GROUP / 2; ++h)
      for (int r = 0; r < R; ++r) k[h][r] = _mm512_set1_epi16(byte_pair(s, j + 2 * h, b, r));
    for (int64_t g = 0; g < p.n; g += 128) {
      next.fetch_span(l.run_byte(g), l.run_byte(g + 128));
      if (j + Q4_GROUP >= b) fetch_scales(l, p.block, super.table_to_fetch(p.table), c0 + g, 128);
      __m512i six[Q4_GROUP / 2][4];
      for (int h = 0; h < Q4_GROUP / 2; ++h) {  // a 128 outputs' 64 bytes of nibbles, then 32 of top bits
        const uint8_t *w0 = w[2 * h], *w1 = w[2 * h + 1];
        __m512i lo0, hi0, lo1, hi1;
        split_six_bits(_mm512_loadu_si512(w0 + q6_nibbles_at(g)), w0 + q6_top_at(g), lo0, hi0);
        split_six_bits(_mm512_loadu_si512(w1 + q6_nibbles_at(g)), w1 + q6_top_at(g), lo1, hi1);
        interleave(lo0, hi0, lo1, hi1, six[h]);
      }
      for (int r = 0; r < R; ++r) add_two_pairs(sums + r * chunk + g, six[0], six[1], k[0][r], k[1][r]);
    }
  }
}

// Q8 runs, R rows, outputs [c0, c0 + chunk) of block i (see avx2::add_q8_piece). Per 32 outputs the
// sums of a row are two vectors in slot order [0 8 1 9 | 4 12 5 13 | 16 24 17 25 | 20 28 21 29] and
// [2 10 3 11 | 6 14 7 15 | 18 26 19 27 | 22 30 23 31] (a pair's int16 interleaved per 128-bit lane).
template <int R>
void add_q8_piece(const RunLayout& layout, const uint8_t* runs, const Selection& s, int64_t i, int64_t c0, int64_t chunk,
                  const avx2::GroupRuns<avx2::Q8_GROUP>& after, float* y, int32_t* acc) {
  using namespace avx2;
  constexpr int P = Q8_GROUP / 2;
  const RunLayout l = with_form<RunForm::Q8>(layout);
  const auto [block, table, j0, j1, scale, k_sum, n] = piece_of<R>(l, runs, s, i, c0, chunk);
  std::fill(acc, acc + R * chunk, 0);
  for (int32_t j = j0; j < j1; j += Q8_GROUP) {
    const auto [here, next] = group_and_next<Q8_GROUP>(l, block, s, j, j1, c0, n, after);
    const uint8_t* const* w = here.w;
    __m512i k[P][R];
    for (int h = 0; h < P; ++h)
      for (int r = 0; r < R; ++r) k[h][r] = _mm512_set1_epi32(wide_pair(s, j + 2 * h, j1, r));
    for (int64_t g = 0; g < n; g += 32) {
      next.fetch(g);
      if (j + Q8_GROUP >= j1) fetch_scales(l, block, table, c0 + g, 32);
      __m512i lo[P], hi[P];
      for (int h = 0; h < P; ++h) {
        const __m512i v0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[2 * h] + g)));
        const __m512i v1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[2 * h + 1] + g)));
        lo[h] = _mm512_unpacklo_epi16(v0, v1), hi[h] = _mm512_unpackhi_epi16(v0, v1);
      }
      for (int r = 0; r < R; ++r) {
        int32_t* a = acc + r * chunk + g;
        __m512i sum_lo = _mm512_load_si512(a), sum_hi = _mm512_load_si512(a + 16);
        for (int h = 0; h < P; ++h) {
          sum_lo = _mm512_dpwssd_epi32(sum_lo, lo[h], k[h][r]);
          sum_hi = _mm512_dpwssd_epi32(sum_hi, hi[h], k[h][r]);
        }
        _mm512_store_si512(a, sum_lo);
        _mm512_store_si512(a + 16, sum_hi);
      }
    }
  }
  // from the two vectors of slot order above: outputs 0-15 (first), 16-31 (first + 8)
  const __m512i first = _mm512_setr_epi32(0, 2, 16, 18, 4, 6, 20, 22, 1, 3, 17, 19, 5, 7, 21, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int64_t g = 0; g < n; g += 32) {
    const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + l.d_at(c0 + g))));
    const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + l.d_at(c0 + g + 16))));
    for (int r = 0; r < R; ++r) {
      if (scale[r] == 0.0f) continue;  // nothing of this row in the block
      const __m512i a = _mm512_load_si512(acc + r * chunk + g), b = _mm512_load_si512(acc + r * chunk + g + 16);
      const __m512 row_scale = _mm512_set1_ps(scale[r]);
      float* yr = y + r * l.padded + c0 + g;
      _mm512_storeu_ps(yr, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(a, first, b)),
                                           _mm512_mul_ps(row_scale, d0), _mm512_loadu_ps(yr)));
      _mm512_storeu_ps(yr + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(a, second, b)),
                                                _mm512_mul_ps(row_scale, d1), _mm512_loadu_ps(yr + 16)));
    }
  }
}

// R rows' blocks with the form's kernel.
template <int R>
void add_form_blocks(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1, float* y) {
  using avx2::add_q4_blocks, avx2::add_q6_piece, avx2::add_q8_blocks;
  switch (l.form) {
    case RunForm::Q4: return add_q4_blocks<R, add_q4_piece<R, RunForm::Q4>>(l, runs, s, i0, i1, y);
    case RunForm::Q4_MIN: return add_q4_blocks<R, add_q4_piece<R, RunForm::Q4_MIN>>(l, runs, s, i0, i1, y);
    case RunForm::Q4_K: return add_q4_blocks<R, add_q4_piece<R, RunForm::Q4_K>>(l, runs, s, i0, i1, y);
    case RunForm::Q6:
      return add_q4_blocks<R, add_q6_piece<R, q6_set_sums<R>, add_q6_round<R>, add_super_block<RunForm::Q6>>, 2>(l, runs, s, i0, i1, y);
    case RunForm::Q8: return add_q8_blocks<R, add_q8_piece<R>>(l, runs, s, i0, i1, y);
  }
}

}  // namespace

void add_runs(const RunLayout& l, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1, float* y) {
  static_assert(GROUP_ROWS == 8, "one kernel per group size");
  switch (s.rows) {
    case 1: return add_form_blocks<1>(l, runs, s, i0, i1, y);
    case 2: return add_form_blocks<2>(l, runs, s, i0, i1, y);
    case 3: return add_form_blocks<3>(l, runs, s, i0, i1, y);
    case 4: return add_form_blocks<4>(l, runs, s, i0, i1, y);
    case 5: return add_form_blocks<5>(l, runs, s, i0, i1, y);
    case 6: return add_form_blocks<6>(l, runs, s, i0, i1, y);
    case 7: return add_form_blocks<7>(l, runs, s, i0, i1, y);
    default: return add_form_blocks<8>(l, runs, s, i0, i1, y);
  }
}

}  // namespace powerinfer::avx512
POWERINFER_TARGET_END
#endif
