// Input-sparse linear layers (TEAL-style activation sparsity): y = x @ W.T where, per row of x,
// the input channels with |x_i| <= threshold_i are skipped and their weights never read.
//
// Layout ("channel runs"), built at load from the file's own row blocks: per block of 32 input
// channels (the row blocks' unit), the block's scales for every output (float16 d, then m where the
// form has one; a byte each where the form has byte_scales), then each of the 32 channels' weights
// for every output, contiguous: a channel's run. A skipped channel is one run never read. Runs must be long: on the
// CPUs measured, reading half of a memory's 1-2 KB pieces took as long as reading all of it, 4 KB
// pieces and more took half (the hardware prefetchers fetch whole pages' neighbours); so a run holds
// all outputs of the matrices of a part (q, k and v side by side, gate and up side by side), and the
// threads split the input blocks, not the outputs.
//   Forms: Q4 (Q4_0 rows: 4-bit q, w = d (q - 8), d = D sc: per output and 256 inputs a float16 D =
//   their largest |d| / 127 in a table after the blocks, per block a signed byte sc (each 64 outputs'
//   bytes in the kernels' order of sums, as every form's scale bytes: q4_scale_slot): 17.25 bytes per 32
//   weights against the file's 18, each d at most D / 2 off; the scales are read whatever is skipped,
//   and as bytes a 7B-width Q4_0 file decoded 1.03-1.05x faster at 40-50 % skipped: AMD EPYC, AVX-512,
//   2 threads); Q4_K (Q4_K rows: w = D sc q + M mn, the file's own
//   6-bit sc and mn per output and block as bytes, its float16 D and M per output and 256 inputs in a
//   table after the blocks: 18.5 bytes per 32 weights against the file's 18); Q4_MIN (Q4_1 rows, and
//   Q4_0 or Q4_K beside them: w = d q + m, float16 d and m per output and block; Q4_K's D sc and M mn
//   rounded to float16: 20 bytes per 32 weights);
//   Q8 (Q8_0 rows: int8 q, w = d q);
//   Q6 (Q6_K rows, their bits: w = D sc (q - 32), 6-bit q as a nibble plane and a 2-bit plane, the
//   file's int8 sc per 16 inputs as two bytes per output and block, its float16 D per output and 256
//   inputs in a table after the blocks: 26.25 bytes per 32 weights, as the file. The kernels join
//   the planes into each channel's 6-bit q, which meets the rows' k in `maddubs` as the Q4 runs'
//   nibbles do. Until it, Q6_K rows were re-quantized to the Q8 form, 34 bytes per 32 weights.)
//   Q6_K is the type of most files' output head and of Q4_K_M's value and down projections.
//   A projection's matrices go in parts, one form each: consecutive matrices of one form share a
//   part (a Q4_K_M file's q and k, then its Q6_K v); all parts take the same selection.
//   Outputs are padded to a multiple of RUN_GROUP (zero weights). Within a run, each 64 outputs of a
//   4-bit form are 32 bytes and each 64 outputs of Q8 are 64 bytes, ordered so that the AVX2 kernel's
//   multiply-adds leave the sums in output order; each 128 outputs of Q6 are 96 bytes, their low
//   nibbles as a 4-bit run's 64, then their top two bits in 32 (q4_slot, q8_slot, q6_slots say where
//   output o lies).
//
// Arithmetic (as the dense row kernels): x rounded to int8 per block of 32 inputs on the block's
// largest active |x| (what llama.cpp's Q8 rounding of the masked x gives), the weights' integers
// times those int8 in integers per block (4-bit: int16, exact: 32 * 8 * 127 fits; Q8: int32), one
// float multiply by d * scale per output and block, plus (m + 8 d) times the block's rounded x sum
// for Q4_MIN (the forms with byte scales: the sums times sc in int32, and Q4_K's minimum as its mn times
// the block's k sum, times the row's scale per block, summed in floats over the super-block and times D,
// and M, once). The scalar path does the same integer arithmetic.
// Rows go in groups (of up to the kernels' GROUP_ROWS): each run of the union of the group's selections
// is read once, each row multiplying it by its own k (0 where the row skips the channel); several groups
// take turns super-block by super-block, each reading what the one before it brought into the cache. Threads take fixed
// ranges of blocks, each summing its own outputs, which are then added: a row's result does not
// depend on the other rows of its call (up to sparse_max_rows rows); it may differ in the last bits
// with the number of threads.
// Many rows (prefill): each row's skipped channels set to 0, the runs repacked 64 outputs at a time
// into the packed chunks of the dense row kernels (quant_matmul.h), which multiply every row (the runs
// stay the only copy; the arithmetic, x's rounding included, is the dense kernels').
// Plain-torch reference: powerinfer/sparse/columns.py.
#pragma once

#include <algorithm>
#include <atomic>
#include <functional>
#include <utility>
#include <vector>

#include "ggml_blocks.h"
#include "projection.h"

namespace powerinfer {

enum class RunForm : int { Q4 = 0, Q4_MIN = 1, Q8 = 2, Q4_K = 3, Q6 = 4 };

// Outputs per step of the kernels (what their registers hold); runs are padded to a multiple.
constexpr int64_t RUN_GROUP = 128;

// Where output o lies in a 4-bit run: its byte, and whether it is that byte's high nibble.
// Each 64 outputs take 32 bytes: byte 2j holds outputs j (low) and 32 + j (high), byte 2j + 1
// outputs 16 + j and 48 + j (j < 16).
inline std::pair<int64_t, bool> q4_slot(int64_t o) {
  const int64_t r = o % 64, j = r % 32;
  return {o / 64 * 32 + (j < 16 ? 2 * j : 2 * (j - 16) + 1), r >= 32};
}

// The byte of output o in a Q8 run: each 16 outputs take 16 bytes, byte 2j output j, byte 2j + 1
// output 8 + j (j < 8).
inline int64_t q8_slot(int64_t o) {
  const int64_t w = o % 16;
  return o / 16 * 16 + (w < 8 ? 2 * w : 2 * (w - 8) + 1);
}

// Where output o's 6 bits lie in a Q6 run: its low nibble's byte and whether it is the high nibble
// (a 4-bit run's place, per 128 outputs 96 bytes: 64 of nibbles, then 32 of top bits); the byte of its
// top two bits and their shift. A 64 outputs' 16 bytes of top bits, broadcast to both 128-bit lanes,
// line up byte by byte with the nibbles: byte j of lane 0 holds at bits 0-1 those of nibble byte j's
// low half and at 4-5 of its high half, byte j of lane 1 at 2-3 and 6-7 those of nibble byte 16 + j.
struct Q6Slots {
  int64_t low_byte;
  bool high_nibble;
  int64_t top_byte;
  int top_shift;
};
// In a Q6 run, where the 32 bytes of nibbles and the 16 bytes of top bits of outputs [g, g + 64) start
// (g a multiple of 64).
inline int64_t q6_nibbles_at(int64_t g) { return g / 128 * 96 + g % 128 / 2; }
inline int64_t q6_top_at(int64_t g) { return g / 128 * 96 + 64 + g % 128 / 4; }
inline Q6Slots q6_slots(int64_t o) {
  const auto [byte, high] = q4_slot(o % 64);  // within the 64 outputs' 32 bytes of nibbles
  const int64_t g = o / 64 * 64;
  return {q6_nibbles_at(g) + byte, high, q6_top_at(g) + byte % 16, static_cast<int>(2 * (byte >= 16) + 4 * high)};
}

// Where output o's scale byte lies among its block's (forms with byte scales): each 64 outputs' 64 bytes in the order of the
// 4-bit kernels' int16 sums (four vectors of 16; lane i = 2 j + p of vector u holds output
// 32 (u / 2) + 4 (u % 2) + 16 p + j + 4 (j >= 4): sparse_input_simd.cpp, in_order), so that a vector of
// sums meets its scales in one load and one `madd`.
// (Unsigned: an output is never negative, and / and % by powers of two are then shifts and masks;
// the kernels compute these per 64 outputs.)
inline int64_t q4_scale_slot(int64_t output) {
  const uint64_t o = static_cast<uint64_t>(output);
  const uint64_t r = o % 64, half = r / 32, p = r % 32 / 16, t = r % 16;
  const uint64_t u = 2 * half + t / 4 % 2, j = t % 4 + 4 * (t / 8);
  return static_cast<int64_t>(o / 64 * 64 + 16 * u + 2 * j + p);
}

inline bool four_bit_form(RunForm f) { return f == RunForm::Q4 || f == RunForm::Q4_MIN || f == RunForm::Q4_K; }

struct RunLayout {
  RunForm form;
  int64_t in_features, out_features, padded;

  int64_t blocks() const { return in_features / QK; }
  bool has_min() const { return form == RunForm::Q4_MIN || form == RunForm::Q4_K; }
  bool four_bit() const { return four_bit_form(form); }
  // Scales as a byte per output and block (Q6: per sub-block) times a float16 per output and
  // super-block (QK_K inputs) in a table after the blocks: Q4's and Q6's signed, Q4_K's unsigned (and
  // its minimums the same way).
  bool byte_scales() const { return form == RunForm::Q4 || form == RunForm::Q4_K || form == RunForm::Q6; }
  // Q6_K's scales are per 16 inputs: a block's first and second half (0 elsewhere: one scale)
  static constexpr int64_t Q6_SUB = 16;
  int64_t sub_blocks() const { return form == RunForm::Q6 ? QK / Q6_SUB : 1; }
  int64_t sub_block(int64_t c) const { return c / (QK / sub_blocks()); }
  // What the integers are centred on: w = d (q - q_offset) for the forms without m (Q8: 0).
  int q_offset() const { return form == RunForm::Q6 ? 32 : form == RunForm::Q8 ? 0 : 8; }
  int64_t scale_bytes() const { return padded * (form == RunForm::Q4 ? 1 : form == RunForm::Q4_MIN ? 4 : 2); }
  int64_t run_bytes() const { return run_byte(padded); }
  int64_t block_bytes() const { return scale_bytes() + QK * run_bytes(); }
  // the table's super-blocks (the last may be short: Q4_0 rows need not be whole ones) and bytes
  static constexpr int64_t BLOCKS_PER_SUPER = QK_K / QK;
  int64_t super_block(int64_t b) const { return b / BLOCKS_PER_SUPER; }
  int64_t super_blocks() const { return super_block(blocks() + BLOCKS_PER_SUPER - 1); }
  int64_t table_entry_bytes() const { return form == RunForm::Q4_K ? 4 : byte_scales() ? 2 : 0; }
  int64_t table_bytes() const { return super_blocks() * table_entry_bytes() * padded; }
  int64_t bytes() const { return blocks() * block_bytes() + table_bytes(); }
  // The byte of a run where output o's weights start (o a multiple of RUN_GROUP).
  int64_t run_byte(int64_t o) const {
    const uint64_t u = static_cast<uint64_t>(o);  // unsigned, as q4_scale_slot
    return static_cast<int64_t>(form == RunForm::Q8 ? u : form == RunForm::Q6 ? u / 4 * 3 : u / 2);
  }
  // within block b (from its start): d of output o (byte_scales: its byte; Q6: of sub-block sub), its m
  // (Q4_K: its mn byte), channel c's run
  // (byte_scales: each 64 outputs' bytes in the kernels' order of sums, q4_scale_slot)
  int64_t d_at(int64_t o, int64_t sub = 0) const { return byte_scales() ? sub * padded + q4_scale_slot(o) : 2 * o; }
  int64_t m_at(int64_t o) const { return form == RunForm::Q4_K ? padded + q4_scale_slot(o) : 2 * padded + 2 * o; }
  // byte_scales: from the start of the runs, the table of block b's super-block; within it D of output
  // o, and M (Q4_K)
  int64_t table_at(int64_t b) const {
    return blocks() * block_bytes() + super_block(b) * table_entry_bytes() * padded;
  }
  int64_t table_d_at(int64_t o) const { return 2 * o; }
  int64_t table_m_at(int64_t o) const { return 2 * padded + 2 * o; }
  int64_t run_at(int64_t c) const { return scale_bytes() + c * run_bytes(); }
};

// The table for block b of a part's runs where the form has one; for the other forms the block itself
// (their kernels never read it as a table).
inline const uint8_t* table_of(const RunLayout& l, const uint8_t* runs, int64_t b) {
  return runs + (l.byte_scales() ? l.table_at(b) : b * l.block_bytes());
}

// The d and m of output o in block b (sub-block sub) of a part's runs (w = d q + m; the forms without
// m: m = -q_offset d).
struct OutputScales {
  float d, m;
};
inline OutputScales scales_at(const RunLayout& l, const uint8_t* runs, int64_t b, int64_t o, int64_t sub = 0) {
  const uint8_t* block = runs + b * l.block_bytes();
  const uint8_t* table = table_of(l, runs, b);
  if (l.form == RunForm::Q4_K)
    return {half_to_float(table + l.table_d_at(o)) * block[l.d_at(o)], half_to_float(table + l.table_m_at(o)) * block[l.m_at(o)]};
  const float d = l.byte_scales() ? half_to_float(table + l.table_d_at(o)) * static_cast<int8_t>(block[l.d_at(o, sub)])
                                  : half_to_float(block + l.d_at(o));
  return {d, l.has_min() ? half_to_float(block + l.m_at(o)) : -static_cast<float>(l.q_offset()) * d};
}

// One form's matrices of a projection: their layout, where its runs start in the projection's runs,
// its first output, and where its sums start in a row's padded outputs.
struct RunPart {
  RunLayout layout;
  int64_t offset, first, first_padded;
};

// The parts of these row matrices (GGML types, outputs) side by side: consecutive matrices of one
// form share a part; throws std::invalid_argument where a type has no form here (then the layer
// stays by rows).
std::vector<RunPart> run_parts(const std::vector<int64_t>& types, const std::vector<int64_t>& outputs, int64_t in_features);
// Bytes of all parts' runs.
int64_t run_bytes(const std::vector<RunPart>& parts);

// Rows computed together: each run is read once for all of them. The AVX-512 kernels take eight (their
// 32 registers hold eight rows' k beside a group's weights: eight sequences of the 7B-width files at 50 %
// decoded 1.06-1.07x faster than in two groups of four, six 1.13x; Intel Xeon, Emerald Rapids, 2
// threads), the others four (eight rows' k fill AVX2's 16 registers: alike there).
namespace scalar {
constexpr int GROUP_ROWS = 4;
}
namespace avx2 {
constexpr int GROUP_ROWS = 4;
}
namespace avx512 {
constexpr int GROUP_ROWS = 8;
}
constexpr int MAX_GROUP_ROWS = std::max({scalar::GROUP_ROWS, avx2::GROUP_ROWS, avx512::GROUP_ROWS});

// A group of rows' selection (1 to MAX_GROUP_ROWS rows): per block where any row has an active
// channel, the union of the rows' active channels; per channel and row, that row's x rounded to int8
// on the row's block scale (0 where the row skips the channel); per block and row, the scale and the
// sum of the row's k (scale 0: the row has nothing in the block).
struct Selection {
  int rows = 1;
  std::vector<int32_t> blocks, start;  // channels of blocks[i]: [start[i], start[i + 1])
  std::vector<uint8_t> channel;        // within its block
  std::vector<int8_t> k;               // [channel index * rows + row]
  std::vector<float> scale;            // [block index * rows + row]
  std::vector<int32_t> k_sum;          // [block index * rows + row]
  int64_t above = 0;  // (row, channel) pairs above their thresholds (with those whose x rounds to 0)
  int64_t active() const { return static_cast<int64_t>(channel.size()); }
};

// Adds blocks [i0, i1) of `s` into y (float32, per row `padded` outputs) from the runs at `runs`.
using RunKernel = void (*)(const RunLayout& layout, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1,
                           float* y);

// The GGML type whose packed chunks (quant_matmul.h) hold a form's runs: the form's own type (the Q4
// form: Q4_0 with d = D sc rounded to float16; Q4_MIN: Q4_1).
GgmlType packed_type(RunForm form);
// Outputs [g, g + 64) of a part's runs (g a multiple of 64) as packed chunks of packed_type(form), per
// output block of 16 its chunks of every block of the inputs, [4][in / n][bytes] (prefill's dense
// kernels read them).
using RunRepacker = void (*)(const RunLayout& layout, const uint8_t* runs, int64_t g, uint8_t* chunks);

namespace scalar {
void add_runs(const RunLayout& layout, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1, float* y);
void repack_runs(const RunLayout& layout, const uint8_t* runs, int64_t g, uint8_t* chunks);
}
namespace avx2 {
void add_runs(const RunLayout& layout, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1, float* y);
void repack_runs(const RunLayout& layout, const uint8_t* runs, int64_t g, uint8_t* chunks);
}
namespace avx512 {
void add_runs(const RunLayout& layout, const uint8_t* runs, const Selection& s, int64_t i0, int64_t i1, float* y);
}

struct SparseInputProjection : Projection {
  torch::Tensor runs;        // uint8 [run_bytes(parts)]
  torch::Tensor thresholds;  // float32 [in]: channel i is active in a row where |x_i| > thresholds[i]
  std::vector<RunPart> parts;
  int64_t sparse_max_rows;  // calls with more rows take the prefill path (sparse_input.cpp says which)

  // rows: per matrix, its raw GGML rows uint8 [outputs, row bytes]; types: their GGML types;
  // destination: where the runs go (the caller's memory, e.g. on huge pages), uint8 of
  // run_bytes(run_parts(...)); after_matrix, given, is called once each matrix is in the runs (to drop
  // its file pages: a large matrix given as slices of rows then never has both copies whole).
  SparseInputProjection(const std::vector<torch::Tensor>& rows, const std::vector<int64_t>& types, int64_t in_features,
                        torch::Tensor thresholds, int64_t sparse_max_rows, torch::Tensor destination,
                        const std::function<void()>& after_matrix = {});
  torch::Tensor operator()(const torch::Tensor& x) const override;

  int64_t in_features() const { return parts.front().layout.in_features; }
  int64_t out_features() const { return parts.back().first + parts.back().layout.out_features; }
  int64_t padded() const { return parts.back().first_padded + parts.back().layout.padded; }
  int64_t blocks() const { return parts.front().layout.blocks(); }
  // (row, channel) pairs the last call selected.
  int64_t last_selected() const { return selected_.load(std::memory_order_relaxed); }
  // Bytes of the runs the last call read: per active block its scales (and table entries) and its
  // active channels' runs; all of them where it read every channel (prefill).
  int64_t last_bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }

 private:
  mutable std::atomic<int64_t> selected_{0}, bytes_read_{0};

  // What a call's rows select, and the bytes of the runs their groups read.
  struct GroupRead {
    int64_t selected, bytes;
  };
  // The bytes of the runs that selection `s` reads.
  int64_t bytes_read(const Selection& s) const;

  // rows (at most MAX_GROUP_ROWS) of x in blocks [b0, b1)
  Selection select(const float* x, int rows, int64_t b0, int64_t b1) const;
  // rows (at most sparse_max_rows) of x into y, in groups of the kernels' GROUP_ROWS
  GroupRead sparse_rows(const float* x, int64_t rows, float* y) const;
  // many rows (prefill): every channel, through the dense kernels
  torch::Tensor dense_prefill(const torch::Tensor& x) const;
};

}  // namespace powerinfer
