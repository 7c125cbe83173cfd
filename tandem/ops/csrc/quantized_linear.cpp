// Linear layers over quantized weights (GGUF's Q8_0, Q6_K, Q4_0, Q4_1, Q4_K, and Q5_0 as Q8_0;
// per-channel int8), in two numerics: float32 activations against the codes widened to float in
// registers (on AVX-512 VNNI, 4-bit codes, and 8-bit ones where AMX runs them, against the
// activations' three integer digits instead: the last sections), or
// activations quantized to int8 per block of 32 and multiplied with integer dot products
// (llama.cpp's numerics: several times fewer instructions per weight).
//
// One layout (tandem/ops/quantized.py packs it): the N output rows in groups of 16, the K inputs
// in blocks of 32, each row's columns in runs of 4 and the 16 rows' runs side by side, so that
// one 32-bit lane is one row's run. For group g and block b:
//   8-bit  [G, B, 8, 64] bytes: values[g, b, j, 4n + t] is row 16g+n, column 32b+4j+t
//   4-bit  [G, B, 4, 64] bytes: the low nibble is column 32b+4j+t, the high one 32b+16+4j+t
//   scales [G, B, 16] float16 or float32; offsets (4-bit) alike: weight = code * scale + offset,
//   none stored for symmetric codes (Q4_0's: offset = -8 * scale, made from the scale)
//   8-bit codes may instead have a scale per 16 columns (Q6_K's sub-blocks), scales [G, B, 32]
//   float32: the block's first 16 columns' 16 scales, then its last 16's. Each half's sums meet
//   their own scales, one after the other; such codes are widened (float activations) or take
//   int8 activations, never the digits or AMX's tiles, whose sums span a block.
// The values' type tells the numerics: int32 "words" (a row's run read as one word: [G, B, 8, 16]
// or [G, B, 4, 16]) for float activations, int8 or uint8 "quads" for int8 activations.
//
// Float activations: one column of a block is the 16 rows' codes in adjacent lanes (a shift of
// the run's words, no widening across lanes), and the product is a sum of outer products (x
// broadcast, codes as vectors): no reduction across lanes, every weight byte read once, in
// order. The scale and offset are taken out of each block's sum:
//   out += (sum of x * code) * scale + (sum of x) * offset
// one FMA per weight instead of two for 4-bit codes (a dequantized weight first, then the
// product), the block's sum of x once per row and call. Within float32 rounding of the
// dequantized model's product; every output is summed in the same order whatever the number of
// rows, so a row's result does not depend on the batch it is in.
//
// Integer products: a dot-product instruction (maddubs + madd, or VNNI's dpbusd) sums a lane's
// 4 products against 4 activation codes broadcast.
// Per row r, output n and block b: integer sum S of code * x code (exact in int32), then
//   out += S * (scale * dx) + offset * (dx * sum of x codes)
// or, for symmetric 4-bit weights (Q4_0: no offsets stored, weight = (code - 8) * scale),
//   out += (S - 8 * sum of x codes) * (scale * dx)
// with dx the block's activation step (max |x| / 127). Every row's sums run in the same order on
// AVX2 and AVX-512 alike and whatever the batch.

#include "experts.h"
#include "tasks.h"
#include "vectors.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace tandem {
namespace {

constexpr int64_t kGroupRows = 16;
constexpr int64_t kBlockCols = 32;
constexpr int64_t kVectors = kGroupRows / kLanes;  // vectors per column of a group
// Rows of x per tile: their accumulators (kVectors each) plus a column of weights and a
// broadcast fit the registers.
constexpr int64_t kTileRows = std::min<int64_t>(12, (kRegisters - 4) / kVectors);
// Rows of x a task keeps in cache while it walks its groups.
constexpr int64_t kChunkRows = 128;

using Column = std::array<VecL, kVectors>;  // one column of a group: 16 rows' weights

// One run of a group's words: 16 rows' words of 4 8-bit or 8 4-bit codes.
using Words = std::array<LanesL, kVectors>;

inline Words load_words(const uint8_t* p) {
  Words w;
  for (int64_t v = 0; v < kVectors; ++v)
    w[v] = *reinterpret_cast<const LanesLUnaligned*>(p + v * kLanes * sizeof(int32_t));
  return w;
}

// Code K of every row of a run, as floats. On AVX-512 a 16-entry table lookup (vpermps reads an
// index's low 4 bits: no mask, no conversion); on AVX2 a shift, a mask and a conversion.
// kInPlace (AVX2, one row of x): no shift, the code masked where it lies and converted, code *
// 16^K exactly (4 significant bits), to meet an x scaled by 16^-K (`in_place_row`): the same
// product without the shift (codes 1-6; code 0 needs none). Code 7 would set the sign bit: it
// is shifted down instead.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kScaledCodes = true;
#else
constexpr bool kScaledCodes = false;
#endif
// Whether a tile of `rows` rows of x meets in-place codes.
constexpr bool in_place_codes(bool four_bit, int64_t rows) {
  return four_bit && kScaledCodes && rows == 1;
}

template <int64_t K, bool kInPlace = false>
inline Column code_column(const Words& w) {
  Column c;
#if defined(__AVX512F__)
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  c[0] = (VecL)_mm512_permutexvar_ps(_mm512_srli_epi32((__m512i)w[0], 4 * K), values);
#elif defined(__AVX2__)
  for (int64_t v = 0; v < kVectors; ++v) {
    const __m256i word = (__m256i)w[v];
    __m256i codes;
    if constexpr (K == 7) codes = _mm256_srli_epi32(word, 28);
    else if constexpr (kInPlace) codes = _mm256_and_si256(word, _mm256_set1_epi32(15 << (4 * K)));
    else codes = _mm256_and_si256(_mm256_srli_epi32(word, 4 * K), _mm256_set1_epi32(15));
    c[v] = (VecL)_mm256_cvtepi32_ps(codes);
  }
#else
  for (int64_t v = 0; v < kVectors; ++v)
    for (int64_t l = 0; l < kLanes; ++l) c[v][l] = (static_cast<uint32_t>(w[v][l]) >> (4 * K)) & 15;
#endif
  return c;
}

// 8-bit code K of every row of a run, as floats: shifted to the top byte, then down with its sign.
template <int64_t K>
inline Column byte_column(const Words& w) {
  Column c;
  for (int64_t v = 0; v < kVectors; ++v) {
#if defined(__AVX512F__)
    const __m512i word = (__m512i)w[v];
    const __m512i top = K == 3 ? word : _mm512_slli_epi32(word, 24 - 8 * K);
    c[v] = (VecL)_mm512_cvtepi32_ps(_mm512_srai_epi32(top, 24));
#elif defined(__AVX2__)
    const __m256i word = (__m256i)w[v];
    const __m256i top = K == 3 ? word : _mm256_slli_epi32(word, 24 - 8 * K);
    c[v] = (VecL)_mm256_cvtepi32_ps(_mm256_srai_epi32(top, 24));
#else
    for (int64_t l = 0; l < kLanes; ++l)
      c[v][l] = static_cast<int8_t>(static_cast<uint32_t>(w[v][l]) >> (8 * K));
#endif
  }
  return c;
}

// Calls f(std::integral_constant<K>) for K in the sequence: compile-time shifts.
template <typename F, int64_t... K>
inline void for_each_code(F&& f, std::integer_sequence<int64_t, K...>) {
  (f(std::integral_constant<int64_t, K>{}), ...);
}

inline Column load_scales(const float* p) {
  Column c;
  for (int64_t v = 0; v < kVectors; ++v) c[v] = load_lanes(p + v * kLanes);
  return c;
}

inline Column load_scales(const c10::Half* p) {
  Column c;
#if defined(__AVX512F__)
  c[0] = (VecL)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
  c[0] = (VecL)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  c[1] = (VecL)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)));
#else
  for (int64_t v = 0; v < kVectors; ++v)
    for (int64_t l = 0; l < kLanes; ++l) c[v][l] = static_cast<float>(p[v * kLanes + l]);
#endif
  return c;
}

// One weight group: its blocks' codes, scales and offsets (null for 8-bit).
template <typename Scale>
struct Group {
  const uint8_t* values;
  const Scale* scales;
  const Scale* offsets;
};

// A weight's groups, evenly strided in memory.
template <typename Scale>
struct Groups {
  const uint8_t* values;
  const Scale* scales;
  const Scale* offsets;  // null for 8-bit
  int64_t group_bytes, group_scales;
  Group<Scale> operator[](int64_t i) const {
    return {values + i * group_bytes, scales + i * group_scales,
            offsets != nullptr ? offsets + i * group_scales : nullptr};
  }
};

// Weight w of the `count` weights that (contiguous) values, scales and offsets hold back to back
// (one weight: w = 0, count = 1), its groups as every kernel walks them; offsets null where none
// are stored (8-bit codes, symmetric 4-bit ones: `quantized_linear` checks which). Pointers, not
// tensor views: a decode step calls this for every quantized layer.
template <typename Scale>
Groups<Scale> groups_of(const at::Tensor& values, const at::Tensor& scales,
                        const at::Tensor& offsets, int64_t w, int64_t count) {
  const int64_t per_weight = values.size(values.dim() - 4), first = w * per_weight;
  const int64_t groups = count * per_weight;
  const int64_t group_bytes = values.numel() / groups * values.element_size();
  const int64_t group_scales = scales.numel() / groups;
  return {static_cast<const uint8_t*>(values.data_ptr()) + first * group_bytes,
          static_cast<const Scale*>(scales.data_ptr()) + first * group_scales,
          present(offsets) ? static_cast<const Scale*>(offsets.data_ptr()) + first * group_scales
                           : nullptr,
          group_bytes, group_scales};
}

// Rows [row0, row0 + rows) of x against one weight, into the same rows of out: one linear layer
// is one job; a layer's experts are a job each, over the rows routed to them (sorted by expert).
template <typename Scale>
struct Job {
  int64_t row0, rows;
  Groups<Scale> weight;
};

// Every job's weight has `groups` groups of `blocks` blocks, in one format.
template <typename Scale>
struct Jobs {
  std::vector<Job<Scale>> list;
  int64_t groups, blocks;
};

// Calls f(job, g0, g1) for every job's groups in chunks of `grain`, all jobs as one task list:
// a layer's experts at decode are a handful of small products, and a parallel region each would
// cost more in waking and joining threads than they compute.
template <typename Scale, typename F>
void parallel_jobs(const Jobs<Scale>& jobs, int64_t grain, const F& f) {
  const int64_t per_job = (jobs.groups + grain - 1) / grain;
  const int64_t tasks = per_job * static_cast<int64_t>(jobs.list.size());
  parallel_chunks(tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g0 = t % per_job * grain;
      f(jobs.list[t / per_job], g0, std::min(jobs.groups, g0 + grain));
    }
  });
}

// kHalves, through the float and integer walks: 8-bit codes with a scale per 16 columns (GGUF's
// Q6_K). A template argument, so that the other weights' walks carry no test for it.
// Block b's 16 scales: its own, or with kHalves its first 16 columns' (half 0) or its last 16's
// (half 1).
template <bool kHalves, typename Scale>
inline const Scale* block_scales(const Group<Scale>& g, int64_t b, int64_t half = 0) {
  return g.scales + (kHalves ? 2 * b + half : b) * kGroupRows;
}

// Runs of 4 columns (one word per row) in a block of 8-bit codes, and in each half of it.
constexpr int64_t kByteRuns = kBlockCols / 4;
constexpr int64_t kHalfRuns = kByteRuns / 2;

// Calls f(j, columns) for the 32 columns of block b in P groups side by side, in the order every
// kernel sums them (j: the column within the block; columns[p]: group p's codes there, as
// floats: exact).
// Only runs [kFirst, kLast) where given (8-bit codes: a half's columns).
template <bool kFourBit, bool kInPlace, int64_t P, int64_t kFirst = 0,
          int64_t kLast = kFourBit ? kBlockCols / 8 : kByteRuns, typename Scale, typename F>
inline void for_each_column(const Group<Scale> (&g)[P], int64_t b, F&& f) {
  constexpr int64_t kRuns = kFourBit ? kBlockCols / 8 : kByteRuns;  // of 64 bytes a block
  constexpr int64_t kRunBytes = 4 * kGroupRows;
  Column w[P];
  for (int64_t j = kFirst; j < kLast; ++j) {
    Words run[P];
    for (int64_t p = 0; p < P; ++p)
      run[p] = load_words(g[p].values + (b * kRuns + j) * kRunBytes);
    if constexpr (kFourBit) {
      for_each_code(
          [&](auto k) {
            constexpr int64_t K = decltype(k)::value;
            for (int64_t p = 0; p < P; ++p) w[p] = code_column<K, kInPlace>(run[p]);
            f((K % 2) * (kBlockCols / 2) + 4 * j + K / 2, w);
          },
          std::make_integer_sequence<int64_t, 8>{});
    } else {
      for_each_code(
          [&](auto k) {
            constexpr int64_t K = decltype(k)::value;
            for (int64_t p = 0; p < P; ++p) w[p] = byte_column<K>(run[p]);
            f(4 * j + K, w);
          },
          std::make_integer_sequence<int64_t, 4>{});
    }
  }
}

// A block's 16 offsets: stored, or -8 * scale for symmetric codes (exact: the same floats).
template <typename Scale>
inline Column block_offsets(const Group<Scale>& g, int64_t b, const Column& scales) {
  if (g.offsets != nullptr) return load_scales(g.offsets + b * kGroupRows);
  Column o;
  for (int64_t v = 0; v < kVectors; ++v) o[v] = scales[v] * -8.f;
  return o;
}

// Adds T rows' sums of x * code over block b of P groups to out, scaled: out += sum * scale (+
// x_sum * offset for 4-bit). The one place a block's sum meets its scale, for every path. With a
// scale per 16 columns, each half's sums meet their own (`half`).
template <bool kFourBit, bool kHalves = false, typename Scale, int64_t T, int64_t P>
inline void add_block(const Group<Scale> (&g)[P], int64_t b, const Column (&sum)[T][P],
                      const float* x_sums, int64_t x_sums_stride, float* out, int64_t out_stride,
                      float sum_scale = 1.f, int64_t half = 0) {
  for (int64_t p = 0; p < P; ++p) {
    Column s = load_scales(block_scales<kHalves>(g[p], b, half));
    Column o{};
    if constexpr (kFourBit) o = block_offsets(g[p], b, s);
    for (int64_t v = 0; v < kVectors; ++v) s[v] *= sum_scale;  // an in-place row's 2^-e
    for (int64_t t = 0; t < T; ++t) {
      float* row = out + t * out_stride + p * kGroupRows;
      for (int64_t v = 0; v < kVectors; ++v) {
        VecL r = load_lanes(row + v * kLanes);
        r += sum[t][p][v] * s[v];
        if constexpr (kFourBit) r += x_sums[t * x_sums_stride + b] * o[v];
        store_lanes(row + v * kLanes, r);
      }
    }
  }
}

// The sum of x over each block of 32 columns, per row ([M, B], 4-bit weights' offsets), in one
// fixed order. The buffer is the calling thread's, reused from call to call.
const float* block_sums_of_x(const at::Tensor& x) {
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlockCols, stride = x.stride(0);
  thread_local std::vector<float> sums;
  sums.resize(rows * blocks);
  const float* xp = x.data_ptr<float>();
  float* sp = sums.data();
  at::parallel_for(0, rows * blocks, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* v = xp + (i / blocks) * stride + (i % blocks) * kBlockCols;
      VecL acc = load_lanes(v);
      for (int64_t l = kLanes; l < kBlockCols; l += kLanes) acc += load_lanes(v + l);
      float total = 0.f;
      for (int64_t l = 0; l < kLanes; ++l) total += acc[l];
      sp[i] = total;
    }
  });
  return sp;
}

// The power of two by which column j of a 4-bit block meets its in-place code: 16^-K for the
// code K that holds it (column (K % 2) * 16 + 4j' + K / 2: the layout above), 1 for K = 7.
inline int column_exponent(int64_t j) {
  const int64_t k = 2 * (j % 4) + j / 16;
  return k == 7 ? 0 : -4 * static_cast<int>(k);
}

// One row of x as the in-place codes meet it (AVX2, 4-bit weights): times 2^e, e from the
// row's max |x| (so that every value times 16^-K, down to 2^-24, stays a normal float at any
// magnitude), column j of each block times a further 2^column_exponent(j). The block scales take
// 2^-e back (`add_block`): powers of two, exact, so each product, sum and rounding is the one the
// shifted codes make on x itself (wherever none of theirs is subnormal), and a row has the same
// bits alone as in a batch. Into `scaled` (k floats).
struct InPlaceRow {
  const float* x;
  float undo;  // 2^-e
};

InPlaceRow in_place_row(const float* row, int64_t k, float* scaled) {
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
  int e = 0;  // an inf or a NaN (not counted by max) spoils its own row, unscaled
  if (std::isfinite(amax) && amax > 0.f) {
    std::frexp(amax, &e);              // amax < 2^e
    e = std::clamp(64 - e, -64, 100);  // a block scale times 2^-e stays normal
  }
  std::array<float, kBlockCols> factors;
  for (int64_t j = 0; j < kBlockCols; ++j) factors[j] = std::ldexp(1.f, e + column_exponent(j));
  for (int64_t i = 0; i < k; ++i) scaled[i] = row[i] * factors[i % kBlockCols];
  return {scaled, std::ldexp(1.f, -e)};
}

// Groups side by side in a one-row tile of 4-bit weights, so that 4 independent sums are in
// flight: a row's sum is a chain of dependent FMAs, two per byte of 4-bit codes, and a single
// chain waits on their latency. 8-bit weights (one FMA per byte) are bound by reading them, and
// more streams side by side read them slower.
constexpr int64_t groups_per_tile(bool four_bit, int64_t rows) {
  return four_bit && rows == 1 ? std::max<int64_t>(1, 4 / kVectors) : 1;
}

// Weight groups per task: at least ~64 KiB of weights (smaller tasks cost more to hand out than
// they save), in whole tiles of `side` groups side by side.
inline int64_t groups_per_task(int64_t group_bytes, int64_t side) {
  const int64_t least = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(group_bytes, 1));
  return (least + side - 1) / side * side;
}

// A group's walk asks for the codes and scales of the block kPrefetchBlocks ahead (1-2 KiB, the
// same bytes in either layout) as it starts each block. Why: with the hardware's prefetcher
// alone, steps of few rows waited on the codes' latency more than on their arithmetic. Past a
// group's end it reads ahead into the next group (a prefetch never faults).
constexpr int64_t kPrefetchBlocks = 4;
// Groups side by side (4-bit, one row) ask 4 KiB ahead together, the next groups' first blocks
// as they near their end: the distance that served AVX2's 2 walks best, and AVX-512's 4 as well
// as any other (experiments.md).
constexpr int64_t blocks_ahead(int64_t side) { return side > 1 ? 16 / side : kPrefetchBlocks; }

template <bool kFourBit, bool kHalves = false, typename Scale>
inline void prefetch_block(const Group<Scale>& g, int64_t b) {
  constexpr int64_t bytes = kBlockCols * kGroupRows / (kFourBit ? 2 : 1);
  const uint8_t* codes = g.values + b * bytes;
  for (int64_t line = 0; line < bytes; line += kCacheLineBytes)
    __builtin_prefetch(codes + line, 0, 3);
  __builtin_prefetch(block_scales<kHalves>(g, b), 0, 3);
  if constexpr (kHalves) __builtin_prefetch(block_scales<kHalves>(g, b, 1), 0, 3);
  if (g.offsets != nullptr) __builtin_prefetch(g.offsets + b * kGroupRows, 0, 3);
}

// T rows of x (T <= kTileRows) against P adjacent groups: each block's sums in registers, times
// sum_scale where they meet the block scales (an in-place row's 2^-e, else 1).
template <bool kFourBit, bool kHalves, typename Scale, int64_t T, int64_t P>
void groups_in_registers(const Group<Scale> (&g)[P], int64_t blocks, const float* x,
                         int64_t x_stride, const float* x_sums, int64_t x_sums_stride, float* out,
                         int64_t out_stride, float sum_scale) {
  for (int64_t t = 0; t < T; ++t) std::fill_n(out + t * out_stride, P * kGroupRows, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlockCols;
    // Past its group's end a walk reads ahead into the group it walks next: P groups on.
    const int64_t ahead = b + blocks_ahead(P);
    const int64_t next = ahead < blocks ? ahead : ahead + (P - 1) * blocks;
    for (int64_t p = 0; p < P; ++p) prefetch_block<kFourBit, kHalves>(g[p], next);
    Column sum[T][P] = {};
    constexpr bool kInPlace = in_place_codes(kFourBit, T);
    auto multiply = [&](int64_t j, const Column (&w)[P]) {
      for (int64_t t = 0; t < T; ++t) {
        const float xv = xb[t * x_stride + j];
        for (int64_t p = 0; p < P; ++p)
          for (int64_t v = 0; v < kVectors; ++v) sum[t][p][v] += xv * w[p][v];
      }
    };
    if constexpr (!kHalves) {
      for_each_column<kFourBit, kInPlace>(g, b, multiply);
      add_block<kFourBit>(g, b, sum, x_sums, x_sums_stride, out, out_stride, sum_scale);
    } else {  // the first 16 columns' sums meet their scales, then the last 16's
      for_each_column<false, false, P, 0, kHalfRuns>(g, b, multiply);
      add_block<false, true>(g, b, sum, x_sums, x_sums_stride, out, out_stride, sum_scale, 0);
      for (auto& row : sum)
        for (auto& group : row) group = Column{};
      for_each_column<false, false, P, kHalfRuns>(g, b, multiply);
      add_block<false, true>(g, b, sum, x_sums, x_sums_stride, out, out_stride, sum_scale, 1);
    }
  }
}

// T rows against the groups [g0, g1) (out: the rows' first column): P at a time, then the rest
// one by one.
template <bool kFourBit, bool kHalves, typename Scale, int64_t T>
void tile_in_registers(const Groups<Scale>& groups, int64_t g0, int64_t g1, int64_t blocks,
                       const float* x, int64_t x_stride, const float* x_sums,
                       int64_t x_sums_stride, float* out, int64_t out_stride, float sum_scale) {
  constexpr int64_t P = groups_per_tile(kFourBit, T);
  int64_t gi = g0;
  if constexpr (P > 1)
    for (; gi + P <= g1; gi += P) {
      Group<Scale> side[P];
      for (int64_t p = 0; p < P; ++p) side[p] = groups[gi + p];
      groups_in_registers<kFourBit, kHalves, Scale, T, P>(side, blocks, x, x_stride, x_sums,
                                                          x_sums_stride, out + gi * kGroupRows,
                                                          out_stride, sum_scale);
    }
  for (; gi < g1; ++gi) {
    const Group<Scale> one[1] = {groups[gi]};
    groups_in_registers<kFourBit, kHalves, Scale, T, 1>(one, blocks, x, x_stride, x_sums,
                                                        x_sums_stride, out + gi * kGroupRows,
                                                        out_stride, sum_scale);
  }
}

// T rows of x against block b, its codes already widened into w (its columns in summation
// order), added to out.
template <bool kFourBit, bool kHalves, typename Scale, int64_t T>
void tile_from_buffer(const Group<Scale> (&g)[1], int64_t b, const float* w, const int64_t* order,
                      const float* x, int64_t x_stride, const float* x_sums, int64_t x_sums_stride,
                      float* out, int64_t out_stride) {
  Column sum[T][1] = {};
  auto multiply = [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t j = order[c];
      Column wc;
      for (int64_t v = 0; v < kVectors; ++v) wc[v] = load_lanes(w + c * kGroupRows + v * kLanes);
      for (int64_t t = 0; t < T; ++t) {
        const float xv = x[t * x_stride + j];
        for (int64_t v = 0; v < kVectors; ++v) sum[t][0][v] += xv * wc[v];
      }
    }
  };
  if constexpr (!kHalves) {
    multiply(0, kBlockCols);
    add_block<kFourBit>(g, b, sum, x_sums, x_sums_stride, out, out_stride);
  } else {  // 8-bit codes, buffered in column order: each half's sums meet their scales
    multiply(0, kBlockCols / 2);
    add_block<false, true>(g, b, sum, x_sums, x_sums_stride, out, out_stride, 1.f, 0);
    for (auto& row : sum) row[0] = Column{};
    multiply(kBlockCols / 2, kBlockCols);
    add_block<false, true>(g, b, sum, x_sums, x_sums_stride, out, out_stride, 1.f, 1);
  }
}

template <bool kFourBit, bool kHalves, typename Scale, int64_t... T>
constexpr auto tile_kernels(std::integer_sequence<int64_t, T...>) {
  using Kernel = void (*)(const Group<Scale>(&)[1], int64_t, const float*, const int64_t*,
                          const float*, int64_t, const float*, int64_t, float*, int64_t);
  return std::array<Kernel, sizeof...(T)>{&tile_from_buffer<kFourBit, kHalves, Scale, T + 1>...};
}

template <bool kFourBit, bool kHalves, typename Scale, int64_t... T>
constexpr auto register_kernels(std::integer_sequence<int64_t, T...>) {
  using Kernel = void (*)(const Groups<Scale>&, int64_t, int64_t, int64_t, const float*, int64_t,
                          const float*, int64_t, float*, int64_t, float);
  return std::array<Kernel, sizeof...(T)>{&tile_in_registers<kFourBit, kHalves, Scale, T + 1>...};
}

// More rows than a tile: each block's codes are widened once into a buffer that every tile reads.
template <bool kFourBit, bool kHalves, typename Scale>
void group_through_buffer(const Group<Scale> (&g)[1], int64_t blocks, const float* x,
                          int64_t x_stride, const float* x_sums, int64_t x_sums_stride,
                          int64_t rows, float* out, int64_t out_stride) {
  static constexpr auto tiles =
      tile_kernels<kFourBit, kHalves, Scale>(std::make_integer_sequence<int64_t, kTileRows>{});
  alignas(64) float w[kBlockCols * kGroupRows];
  int64_t order[kBlockCols];
  for (int64_t t = 0; t < rows; ++t) std::fill_n(out + t * out_stride, kGroupRows, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_block<kFourBit, kHalves>(g[0], b + kPrefetchBlocks);
    int64_t c = 0;
    for_each_column<kFourBit, false>(g, b, [&](int64_t j, const Column (&col)[1]) {
      order[c] = j;
      for (int64_t v = 0; v < kVectors; ++v)
        store_lanes(w + c * kGroupRows + v * kLanes, col[0][v]);
      ++c;
    });
    for (int64_t t = 0; t < rows; t += kTileRows) {
      const int64_t n = std::min(kTileRows, rows - t);
      const float* tile_sums = kFourBit ? x_sums + t * x_sums_stride : nullptr;
      tiles[n - 1](g, b, w, order, x + t * x_stride + b * kBlockCols, x_stride, tile_sums,
                   x_sums_stride, out + t * out_stride, out_stride);
    }
  }
}

template <bool kFourBit, bool kHalves, typename Scale>
void run(const at::Tensor& x, const Jobs<Scale>& jobs, at::Tensor& out) {
  static constexpr auto in_registers =
      register_kernels<kFourBit, kHalves, Scale>(std::make_integer_sequence<int64_t, kTileRows>{});
  const int64_t x_stride = x.stride(0), blocks = jobs.blocks, n = out.size(1), k = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* sums = kFourBit ? block_sums_of_x(x) : nullptr;
  // A job's last chunk of one row meets in-place codes (AVX2, 4-bit): that row scaled here.
  const int64_t num_jobs = static_cast<int64_t>(jobs.list.size());
  thread_local std::vector<float> scaled;
  std::vector<InPlaceRow> last(num_jobs);
  if constexpr (in_place_codes(kFourBit, 1)) {
    scaled.resize(num_jobs * k);
    for (int64_t j = 0; j < num_jobs; ++j) {
      const Job<Scale>& job = jobs.list[j];
      if (job.rows % kChunkRows == 1)
        last[j] = in_place_row(xp + (job.row0 + job.rows - 1) * x_stride, k, &scaled[j * k]);
    }
  }
  float* outp = out.data_ptr<float>();
  const Job<Scale>* first_job = jobs.list.data();
  const int64_t grain =
      groups_per_task(first_job->weight.group_bytes, groups_per_tile(kFourBit, 1));
  parallel_jobs(jobs, grain, [&](const Job<Scale>& job, int64_t g0, int64_t g1) {
    const InPlaceRow& job_last = last[&job - first_job];
    for (int64_t m0 = job.row0; m0 < job.row0 + job.rows; m0 += kChunkRows) {
      const int64_t m = std::min(kChunkRows, job.row0 + job.rows - m0);
      float* o = outp + m0 * n;
      const bool in_place = in_place_codes(kFourBit, m);
      const float* xm = in_place ? job_last.x : xp + m0 * x_stride;
      const float* sm = kFourBit ? sums + m0 * blocks : nullptr;
      if (m <= kTileRows) {
        in_registers[m - 1](job.weight, g0, g1, blocks, xm, x_stride, sm, blocks, o, n,
                            in_place ? job_last.undo : 1.f);
        continue;
      }
      for (int64_t gi = g0; gi < g1; ++gi) {
        const Group<Scale> one[1] = {job.weight[gi]};
        group_through_buffer<kFourBit, kHalves>(one, blocks, xm, x_stride, sm, blocks, m,
                                                o + gi * kGroupRows, n);
      }
    }
  });
}

// ---- Integer products: int8 activations ----

constexpr int64_t kQuadBytes = 4 * kGroupRows;  // one run of 4 columns for the group's 16 rows

// Activations quantized per row and block of 32: codes, step dx and the sum of codes. The
// buffers are the calling thread's, reused from call to call: a step makes a hundred of these,
// and three allocations each cost more than quantizing a decode row.
struct QuantizedRows {
  const int8_t* codes;       // [M, K]
  const float* steps;        // [M, B]
  const int32_t* code_sums;  // [M, B]
};

// llama.cpp's Q8_0 rounding: dx = max|x| / 127, code = nearest-even(x * (127 / max|x|)).
QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlockCols, stride = x.stride(0);
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> steps;
  thread_local std::vector<int32_t> code_sums;
  codes.resize(rows * k);
  steps.resize(rows * blocks);
  code_sums.resize(rows * blocks);
  const float* xp = x.data_ptr<float>();
  int8_t* cp = codes.data();
  float* dp = steps.data();
  int32_t* csp = code_sums.data();
  at::parallel_for(0, rows * blocks, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / blocks, b = i % blocks;
      const float* v = xp + r * stride + b * kBlockCols;
      int8_t* c = cp + r * k + b * kBlockCols;
      float amax = 0.f;
      for (int64_t j = 0; j < kBlockCols; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float step = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlockCols; ++j) {
        c[j] = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
        sum += c[j];
      }
      dp[i] = step;
      csp[i] = sum;
    }
  });
  return {cp, dp, csp};
}

// A run of 4 activation codes as one 32-bit value, to broadcast to every lane.
inline int32_t four_codes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The dot-product vocabulary over one vector of 32-bit lanes, each a row's run of 4 codes.
#if defined(__AVX512BW__)
using IVec = __m512i;
inline IVec load_codes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec broadcast4(const int8_t* p) { return _mm512_set1_epi32(four_codes(p)); }
inline IVec low_nibbles(IVec v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline IVec high_nibbles(IVec v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
}
inline IVec abs8(IVec v) { return _mm512_abs_epi8(v); }
// x with the sign of w (x * sign(w); w = 0 is multiplied by |w| = 0 anyway).
inline IVec sign_of(IVec x, IVec w) {
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
inline IVec zero_ints() { return _mm512_setzero_si512(); }
// acc + per lane the 4 products u8 * s8 (|u * s| <= 128 * 127, so maddubs' pair sum fits).
inline IVec dot4(IVec acc, IVec u, IVec s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
// A block's 4-bit products: acc + two runs of 4 products per lane (u < 16). Without VNNI the
// sums stay in 16 bits for the whole block (16 products of at most 15 * 127 fit) and widen once.
inline IVec nibble_dot8(IVec acc, IVec u1, IVec s1, IVec u2, IVec s2) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, u1, s1), u2, s2);
#else
  const IVec pairs = _mm512_add_epi16(_mm512_maddubs_epi16(u1, s1), _mm512_maddubs_epi16(u2, s2));
  return _mm512_add_epi16(acc, pairs);
#endif
}
inline IVec nibble_total(IVec acc) {
#if defined(__AVX512VNNI__)
  return acc;
#else
  return _mm512_madd_epi16(acc, _mm512_set1_epi16(1));
#endif
}
inline VecL to_float(IVec v) { return (VecL)_mm512_cvtepi32_ps(v); }
inline IVec minus(IVec v, int32_t c) { return _mm512_sub_epi32(v, _mm512_set1_epi32(c)); }
inline IVec plus(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec shift_left8(IVec v) { return _mm512_slli_epi32(v, 8); }
#define TANDEM_INTEGER_VECTORS 1
#elif defined(__AVX2__) && !defined(__AVX512F__)
using IVec = __m256i;
inline IVec load_codes(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline IVec broadcast4(const int8_t* p) { return _mm256_set1_epi32(four_codes(p)); }
inline IVec low_nibbles(IVec v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline IVec high_nibbles(IVec v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
}
inline IVec abs8(IVec v) { return _mm256_abs_epi8(v); }
inline IVec sign_of(IVec x, IVec w) { return _mm256_sign_epi8(x, w); }
inline IVec zero_ints() { return _mm256_setzero_si256(); }
inline IVec dot4(IVec acc, IVec u, IVec s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline IVec nibble_dot8(IVec acc, IVec u1, IVec s1, IVec u2, IVec s2) {
  return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(u1, s1),
                                                _mm256_maddubs_epi16(u2, s2)));
}
inline IVec nibble_total(IVec acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
inline VecL to_float(IVec v) { return (VecL)_mm256_cvtepi32_ps(v); }
inline IVec minus(IVec v, int32_t c) { return _mm256_sub_epi32(v, _mm256_set1_epi32(c)); }
#define TANDEM_INTEGER_VECTORS 1
#endif

// Rows of x per tile: per row and vector a float and an integer accumulator, plus the weights,
// two broadcasts and the constants in the registers.
constexpr int64_t kIntTileRows = std::min<int64_t>(8, (kRegisters - 8) / (2 * kVectors));

// The portable integer sum of block b for row n (the vector code's result, lane by lane); of
// 8-bit codes, runs [j0, j1) only.
template <bool kFourBit>
inline int32_t block_sum(const uint8_t* values, int64_t b, int64_t n, const int8_t* xq,
                         int64_t j0 = 0, int64_t j1 = kByteRuns) {
  int32_t sum = 0;
  if constexpr (kFourBit) {
    const uint8_t* q = values + b * 4 * kQuadBytes;
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t t = 0; t < 4; ++t) {
        const uint8_t v = q[j * kQuadBytes + 4 * n + t];
        sum += (v & 15) * xq[4 * j + t] + (v >> 4) * xq[16 + 4 * j + t];
      }
  } else {
    const auto* q = reinterpret_cast<const int8_t*>(values) + b * 8 * kQuadBytes;
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t t = 0; t < 4; ++t) sum += q[j * kQuadBytes + 4 * n + t] * xq[4 * j + t];
  }
  return sum;
}

// T rows of quantized x against one group, accumulators in registers. kSymmetric: 4-bit codes
// whose weight is (code - 8) * scale, no offsets stored.
template <bool kFourBit, bool kSymmetric, bool kHalves, typename Scale, int64_t T>
void int_group_rows(const Group<Scale>& g, int64_t blocks, const int8_t* xq, int64_t xq_stride,
                    const float* steps, const int32_t* code_sums, int64_t step_stride,
                    float* out, int64_t out_stride) {
  Column acc[T] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_block<kFourBit, kHalves>(g, b + kPrefetchBlocks);
    const Column s = load_scales(block_scales<kHalves>(g, b));
#if defined(TANDEM_INTEGER_VECTORS)
    {
      IVec isum[T][kVectors];
      auto clear = [&] {
        for (int64_t t = 0; t < T; ++t)
          for (int64_t v = 0; v < kVectors; ++v) isum[t][v] = zero_ints();
      };
      auto add_sums = [&](const Column& scale) {
        for (int64_t t = 0; t < T; ++t) {
          const float step = steps[t * step_stride + b];
          for (int64_t v = 0; v < kVectors; ++v)
            acc[t][v] += to_float(isum[t][v]) * (scale[v] * step);
        }
      };
      clear();
      if constexpr (kFourBit) {
        const uint8_t* q = g.values + b * 4 * kQuadBytes;
        for (int64_t j = 0; j < 4; ++j)
          for (int64_t v = 0; v < kVectors; ++v) {
            const IVec packed = load_codes(q + j * kQuadBytes + v * 4 * kLanes);
            const IVec lo = low_nibbles(packed), hi = high_nibbles(packed);
            for (int64_t t = 0; t < T; ++t) {
              const int8_t* xb = xq + t * xq_stride + b * kBlockCols;
              isum[t][v] = nibble_dot8(isum[t][v], lo, broadcast4(xb + 4 * j), hi,
                                       broadcast4(xb + 16 + 4 * j));
            }
          }
        for (int64_t t = 0; t < T; ++t)
          for (int64_t v = 0; v < kVectors; ++v) {
            isum[t][v] = nibble_total(isum[t][v]);
            if constexpr (kSymmetric)
              isum[t][v] = minus(isum[t][v], 8 * code_sums[t * step_stride + b]);
          }
      } else {
        const uint8_t* q = g.values + b * 8 * kQuadBytes;
        auto multiply = [&](int64_t j0, int64_t j1) {
          for (int64_t j = j0; j < j1; ++j)
            for (int64_t v = 0; v < kVectors; ++v) {
              const IVec w = load_codes(q + j * kQuadBytes + v * 4 * kLanes),
                         magnitude = abs8(w);
              for (int64_t t = 0; t < T; ++t) {
                const IVec xb = broadcast4(xq + t * xq_stride + b * kBlockCols + 4 * j);
                isum[t][v] = dot4(isum[t][v], magnitude, sign_of(xb, w));
              }
            }
        };
        multiply(0, kHalfRuns);
        if constexpr (kHalves) {  // the first 16 columns' sums meet their scales
          add_sums(s);
          clear();
        }
        multiply(kHalfRuns, kByteRuns);
      }
      add_sums(kHalves ? load_scales(block_scales<kHalves>(g, b, 1)) : s);
    }
#else
    {
      const Column last = load_scales(block_scales<kHalves>(g, b, 1));
      for (int64_t t = 0; t < T; ++t) {
        const float step = steps[t * step_stride + b];
        const int8_t* xb = xq + t * xq_stride + b * kBlockCols;
        for (int64_t v = 0; v < kVectors; ++v)
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t n = v * kLanes + l;
            if constexpr (kHalves) {
              const int32_t first = block_sum<false>(g.values, b, n, xb, 0, kHalfRuns);
              acc[t][v][l] += static_cast<float>(first) * (s[v][l] * step);
              const int32_t second = block_sum<false>(g.values, b, n, xb, kHalfRuns, kByteRuns);
              acc[t][v][l] += static_cast<float>(second) * (last[v][l] * step);
              continue;
            }
            int32_t sum = block_sum<kFourBit>(g.values, b, n, xb);
            if constexpr (kSymmetric) sum -= 8 * code_sums[t * step_stride + b];
            acc[t][v][l] += static_cast<float>(sum) * (s[v][l] * step);
          }
      }
    }
#endif
    if constexpr (kFourBit && !kSymmetric) {
      const Column o = load_scales(g.offsets + b * kGroupRows);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t i = t * step_stride + b;
        const float xsum = steps[i] * static_cast<float>(code_sums[i]);  // dx * sum of x codes
        for (int64_t v = 0; v < kVectors; ++v) acc[t][v] += o[v] * xsum;
      }
    }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < kVectors; ++v)
      store_lanes(out + t * out_stride + v * kLanes, acc[t][v]);
}

template <bool kFourBit, bool kSymmetric, bool kHalves, typename Scale, int64_t... T>
constexpr auto int_kernels(std::integer_sequence<int64_t, T...>) {
  using Kernel = void (*)(const Group<Scale>&, int64_t, const int8_t*, int64_t, const float*,
                          const int32_t*, int64_t, float*, int64_t);
  return std::array<Kernel, sizeof...(T)>{
      &int_group_rows<kFourBit, kSymmetric, kHalves, Scale, T + 1>...};
}

template <bool kFourBit, bool kSymmetric, bool kHalves, typename Scale>
void run_integer(const at::Tensor& x, const Jobs<Scale>& jobs, at::Tensor& out) {
  static constexpr auto tiles = int_kernels<kFourBit, kSymmetric, kHalves, Scale>(
      std::make_integer_sequence<int64_t, kIntTileRows>{});
  const QuantizedRows xq = quantize_rows(x);
  const int64_t blocks = jobs.blocks, n = out.size(1), k = x.size(1);
  const int8_t* cp = xq.codes;
  const float* dp = xq.steps;
  float* outp = out.data_ptr<float>();
  const int64_t grain = groups_per_task(jobs.list[0].weight.group_bytes, 1);
  parallel_jobs(jobs, grain, [&](const Job<Scale>& job, int64_t g0, int64_t g1) {
    for (int64_t m0 = job.row0; m0 < job.row0 + job.rows; m0 += kChunkRows) {
      const int64_t m = std::min(kChunkRows, job.row0 + job.rows - m0);
      for (int64_t gi = g0; gi < g1; ++gi) {
        const Group<Scale> g = job.weight[gi];
        for (int64_t t = 0; t < m; t += kIntTileRows) {
          const int64_t r = m0 + t;
          tiles[std::min(kIntTileRows, m - t) - 1](g, blocks, cp + r * k, k, dp + r * blocks,
                                                   xq.code_sums + r * blocks, blocks,
                                                   outp + r * n + gi * kGroupRows, n);
        }
      }
    }
  });
}

// ---- Float activations as three integer digits (AVX-512 VNNI) ----
//
// A row's block of 32 activations is held as integers X = x / step, step = max|x| / kDigitMax,
// and X as three signed bytes, X = d2 * 65536 + d1 * 256 + d0. The block's sum of x * code is
// then three integer dot products of the codes with the digits (exact in int32, 4 products per
// instruction), put together in float: ((sum d2 * 256 + sum d1, exact in int32) * 256 + sum d0)
// / kDigitMax * max|x| (the step never formed, so that tiny activations do not make it
// subnormal). Rounding x to a multiple of the step moves it by at most step / 2, 2^-24 of the
// block's largest |x|: no more than float32 rounds that activation itself. So the product stays
// within float32 rounding of the dequantized model's, and a row's result still does not depend
// on its batch, while a code costs three quarters of a VNNI instruction per row instead of a
// widening and an FMA. dpbusd multiplies unsigned bytes by signed ones: 8-bit codes go in
// offset by 128 (their sign bit flipped), and each sum starts at -128 times the block's sum of
// its digit, which takes the offset back out, exactly; symmetric 4-bit codes (Q4_0's) start at
// -8 times it, so that the sums are of code - 8, the weight over its scale, and no offset term
// is left to round. Only where VNNI sums 4 products in one instruction: AVX2's
// three-instruction dot products lose to widening once a step has more than one row; and 8-bit
// codes only where AMX tiles run the products from 4 rows.
#if defined(TANDEM_INTEGER_VECTORS) && defined(__AVX512VNNI__)
#define TANDEM_DIGIT_PRODUCTS 1

constexpr int64_t kDigits = 3;
constexpr int32_t kDigitMax = 127 * (65536 + 256 + 1);  // the largest |X|: every digit <= 127

// How a weight's codes meet the digits: weight = code * scale (8-bit, signed), (code - 8) *
// scale (symmetric 4-bit), or code * scale + offset (4-bit with stored offsets).
enum class Codes { kEightBit, kSymmetric, kOffsets };
constexpr bool four_bit(Codes c) { return c != Codes::kEightBit; }
// What VNNI's unsigned side adds to a code, taken back out of each sum: 128 (8-bit codes go in
// with their sign bit flipped), 8 (symmetric 4-bit: the sums are of code - 8), or 0.
constexpr int32_t code_bias(Codes c) {
  return c == Codes::kEightBit ? 128 : c == Codes::kSymmetric ? 8 : 0;
}

// Each row's blocks as digits, for rows [r, M) where a view starts at row r. The buffers are the
// calling thread's, reused from call to call.
struct DigitRows {
  const int8_t* digits;       // [M, B, 3, 32]: a block's d0, then its d1, then its d2
  const float* amax;          // [M, B]: max |x|
  const int32_t* starts;      // [M, B, 3]: -code_bias times each digit's sum over the block
  int64_t blocks;

  DigitRows from_row(int64_t r) const {
    return {digits + r * blocks * kDigits * kBlockCols, amax + r * blocks,
            starts + r * blocks * kDigits, blocks};
  }
  // Row t's digit k of block b: 32 bytes.
  const int8_t* digit(int64_t t, int64_t b, int64_t k) const {
    return digits + ((t * blocks + b) * kDigits + k) * kBlockCols;
  }
  int64_t row_bytes() const { return blocks * kDigits * kBlockCols; }
};

// A block's max |x| and whether all its x are finite, 16 lanes at a time: a scalar running max
// and the finiteness beside it were two chains of dependent compares per value.
// (Where every x is finite the max is exact in any order; otherwise only `false` is used.)
inline bool block_max_abs(const float* v, float& amax) {
  static_assert(kBlockCols == 32, "a block is two vectors");
  const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(v)), b = _mm512_abs_ps(_mm512_loadu_ps(v + 16));
  const __m512 top = _mm512_set1_ps(std::numeric_limits<float>::max());
  const __mmask16 ok =
      _mm512_cmp_ps_mask(a, top, _CMP_LE_OQ) & _mm512_cmp_ps_mask(b, top, _CMP_LE_OQ);
  amax = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
  return ok == 0xFFFF;
}

// A block's 32 activations as three digits each (d: [3, 32]) and each digit's sum times
// -bias: X = nearest-even(x * inverse) in double (the rounding mode's default), clamped to
// kDigitMax, then balanced base 256, each digit in [-128, 127]. 16 lanes at a time.
inline void block_digits(const float* v, double inverse, int32_t bias, int8_t* d,
                         int32_t* starts) {
  const __m512d scale = _mm512_set1_pd(inverse);
  const __m512i top = _mm512_set1_epi32(kDigitMax), bottom = _mm512_set1_epi32(-kDigitMax);
  __m512i total[kDigits] = {};
  for (int64_t h = 0; h < kBlockCols; h += 16) {
    const __m512 x = _mm512_loadu_ps(v + h);
    const __m512d first = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d second = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    const __m256i lo = _mm512_cvtpd_epi32(_mm512_mul_pd(first, scale));
    const __m256i hi = _mm512_cvtpd_epi32(_mm512_mul_pd(second, scale));
    __m512i rest = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    rest = _mm512_min_epi32(_mm512_max_epi32(rest, bottom), top);
    for (int64_t k = 0; k < kDigits; ++k) {
      const __m512i digit = _mm512_srai_epi32(_mm512_slli_epi32(rest, 24), 24);  // the low byte
      const __m128i bytes = _mm512_cvtepi32_epi8(digit);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + k * kBlockCols + h), bytes);
      total[k] = _mm512_add_epi32(total[k], digit);
      rest = _mm512_srai_epi32(_mm512_sub_epi32(rest, digit), 8);
    }
  }
  for (int64_t k = 0; k < kDigits; ++k) starts[k] = -bias * _mm512_reduce_add_epi32(total[k]);
}

// x's digits for codes with the given bias (code_bias).
DigitRows digit_rows(const at::Tensor& x, int32_t bias) {
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlockCols, stride = x.stride(0);
  thread_local std::vector<int8_t> digits;
  thread_local std::vector<float> amaxes;
  thread_local std::vector<int32_t> sums;
  digits.resize(rows * blocks * kDigits * kBlockCols);
  amaxes.resize(rows * blocks);
  sums.resize(rows * blocks * kDigits);
  // Pointers, not the vectors, inside the tasks: a thread_local names the running thread's own.
  int8_t* dp = digits.data();
  float* ap = amaxes.data();
  int32_t* sp = sums.data();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows * blocks, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* v = xp + (i / blocks) * stride + (i % blocks) * kBlockCols;
      int8_t* d = dp + i * kDigits * kBlockCols;
      float amax;
      const bool finite = block_max_abs(v, amax);
      // A block with an inf or a NaN gets a NaN max, which its outputs then carry, as a float
      // product's; it and an all-zero block get zero digits.
      ap[i] = finite ? amax : std::nanf("");
      if (finite && amax > 0.f) {  // in double, so that tiny activations do not overflow it
        const double inverse = kDigitMax / static_cast<double>(amax);
        block_digits(v, inverse, bias, d, sp + i * kDigits);
      } else {
        std::fill_n(d, kDigits * kBlockCols, int8_t{0});
        std::fill_n(sp + i * kDigits, kDigits, 0);
      }
    }
  });
  return {dp, ap, sp, blocks};
}

// Only AVX-512 builds have VNNI here: a group's 16 rows are one vector.
static_assert(kVectors == 1, "the digit kernels take a group as one vector");

// A row's block from its three digit sums (one lane per output): acc += x . codes * scale (+
// (sum of x) * offset where offsets are stored). The one place the sums meet the scales, for
// every path, so that a row has the same bits on each.
template <Codes C>
inline void add_digit_block(VecL& acc, const IVec (&sums)[kDigits], float x_max, float x_sum,
                            VecL scale, VecL offset) {
  const IVec upper = plus(shift_left8(sums[2]), sums[1]);
  const VecL total = to_float(upper) * 256.f + to_float(sums[0]);
  const VecL x_dot_codes = total * (1.f / kDigitMax) * x_max;
  acc += x_dot_codes * scale;
  if constexpr (C == Codes::kOffsets) acc += x_sum * offset;
}

// A block's 16 scales and stored offsets as the digit kernels meet them.
template <Codes C, typename Scale>
inline std::pair<VecL, VecL> digit_scales(const Group<Scale>& g, int64_t b) {
  const VecL s = load_scales(g.scales + b * kGroupRows)[0];
  if constexpr (C == Codes::kOffsets) return {s, load_scales(g.offsets + b * kGroupRows)[0]};
  return {s, VecL{}};
}

// Runs of 64 code bytes per block.
constexpr int64_t runs_per_block(bool four_bit) {
  return four_bit ? kBlockCols / 8 : kBlockCols / 4;
}

// Rows per tile: per row three integer sums (six at one row: two chains, so that enough
// independent dot products are in flight), plus the codes and broadcasts.
constexpr int64_t kDigitTileRows = (kRegisters - 6) / 4;

// T rows against one group: out (the rows' first column) = x . codes * scale (+ (sum of x) *
// offset), each block's integer sums in registers.
template <Codes C, typename Scale, int64_t T>
void digit_group_rows(const Group<Scale>& g, const DigitRows& x, const float* x_sums, float* out,
                      int64_t out_stride) {
  constexpr int64_t kChains = T == 1 ? 2 : 1;
  constexpr bool kFourBit = four_bit(C);
  constexpr int64_t kRuns = runs_per_block(kFourBit);
  const int64_t blocks = x.blocks;
  VecL acc[T] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_block<kFourBit>(g, b + kPrefetchBlocks);
    IVec isum[T][kDigits][kChains];
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < kDigits; ++k) {
        // The first chain starts where the codes' bias is taken back out.
        const int32_t start = x.starts[(t * blocks + b) * kDigits + k];
        for (int64_t c = 0; c < kChains; ++c)
          isum[t][k][c] = c == 0 ? _mm512_set1_epi32(start) : zero_ints();
      }
    for (int64_t j = 0; j < kRuns; ++j) {
      const IVec packed = load_codes(g.values + (b * kRuns + j) * kQuadBytes);
      if constexpr (kFourBit) {
        const IVec lo = low_nibbles(packed), hi = high_nibbles(packed);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t k = 0; k < kDigits; ++k) {
            const int8_t* d = x.digit(t, b, k) + 4 * j;
            const IVec dl = broadcast4(d), dh = broadcast4(d + 16);
            if constexpr (kChains == 2) {
              isum[t][k][0] = dot4(isum[t][k][0], lo, dl);
              isum[t][k][1] = dot4(isum[t][k][1], hi, dh);
            } else {
              isum[t][k][0] = nibble_dot8(isum[t][k][0], lo, dl, hi, dh);
            }
          }
        }
      } else {
        const IVec offset = _mm512_xor_si512(packed, _mm512_set1_epi8(-128));  // code + 128
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t k = 0; k < kDigits; ++k) {
            IVec& sum = isum[t][k][j % kChains];
            sum = dot4(sum, offset, broadcast4(x.digit(t, b, k) + 4 * j));
          }
        }
      }
    }
    const auto [s, o] = digit_scales<C>(g, b);
    for (int64_t t = 0; t < T; ++t) {
      const float x_sum = C == Codes::kOffsets ? x_sums[t * blocks + b] : 0.f;
      IVec sums[kDigits];
      for (int64_t k = 0; k < kDigits; ++k)
        sums[k] = kChains == 2 ? plus(isum[t][k][0], isum[t][k][1]) : nibble_total(isum[t][k][0]);
      add_digit_block<C>(acc[t], sums, x.amax[t * blocks + b], x_sum, s, o);
    }
  }
  for (int64_t t = 0; t < T; ++t) store_lanes(out + t * out_stride, acc[t]);
}

template <Codes C, typename Scale, int64_t... T>
constexpr auto digit_kernels(std::integer_sequence<int64_t, T...>) {
  using Kernel = void (*)(const Group<Scale>&, const DigitRows&, const float*, float*, int64_t);
  return std::array<Kernel, sizeof...(T)>{&digit_group_rows<C, Scale, T + 1>...};
}

// From this many rows on, a call runs on AMX tiles where it can (below). Each block costs the
// tiles a fixed latency (loads, three products, stores) whatever the rows: below 8 rows of 4-bit
// codes (unpacked for the tiles first) and 4 of 8-bit ones VNNI is sooner (experiments.md).
constexpr int64_t amx_least_rows(bool four_bit) { return four_bit ? 8 : 4; }

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define TANDEM_AMX_DIGITS 1

// ---- The same digit products on AMX tiles (Intel Sapphire Rapids and later) ----
//
// One tile multiply sums a block of a group for up to 16 rows of x at once (16 x 16 x 32
// products, where VNNI takes 24 instructions per row), one per digit; the sums then meet the
// scales in `add_digit_block`, so a row's bits are those of the VNNI kernel, alone or in any
// batch. The tiles: 0-2 the digits' int32 sums [rows, 16], 3-5 the digits [rows, 32] (signed),
// 6 the group's codes [8, 64] (row j holds columns 4j..4j+3 of the 16 output rows: 8-bit codes
// as they are stored, signed; 4-bit ones unpacked, the low nibbles of quad j for j < 4, the
// high ones of quad j - 4 after, unsigned, or less 8 and signed where symmetric).

// Whether this process may use the tiles: Linux grants their 8 KiB of state on request only.
bool amx_granted() {
  static const bool granted = [] {
    constexpr int kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr int kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

constexpr int64_t kAmxTileRows = 16;  // rows of x per tile multiply: the most a tile holds

// The calling thread's tile shapes for tiles of `rows` rows of x. A compiler barrier keeps the
// configuration's stores: GCC 12's _tile_loadconfig tells the compiler it reads 8 of the 64
// bytes, so it dropped the rest as dead stores where the function was inlined.
void configure_tiles(int64_t rows) {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t row_bytes[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int k = 0; k < kDigits; ++k) {
    config.rows[k] = config.rows[3 + k] = static_cast<uint8_t>(rows);
    config.row_bytes[k] = kGroupRows * sizeof(int32_t);
    config.row_bytes[3 + k] = kBlockCols;
  }
  config.rows[6] = kBlockCols / 4;
  config.row_bytes[6] = kQuadBytes;
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

constexpr int64_t kTileCodeBytes = kBlockCols / 4 * kQuadBytes;  // a block's codes as tile 6

// T rows (the tiles' shape) against one group, every block: out (the rows' first column) = x .
// codes * scale (+ (sum of x) * offset), `codes` a block per kTileCodeBytes (`tile_codes`).
// Each block's tile products are issued before the previous block's sums meet their scales, and
// stored after: the tile unit's latency then overlaps the vector work instead of stalling it.
template <Codes C, typename Scale, int64_t T>
void amx_group_rows(const Group<Scale>& g, const uint8_t* codes, const DigitRows& x,
                    const float* x_sums, float* out, int64_t out_stride) {
  alignas(64) int32_t sums[kDigits][T][kGroupRows];
  const int64_t blocks = x.blocks;
  VecL acc[T] = {};
  auto scale_block = [&](int64_t b) {
    const auto [s, o] = digit_scales<C>(g, b);
    for (int64_t t = 0; t < T; ++t) {
      IVec row[kDigits];
      for (int64_t k = 0; k < kDigits; ++k) row[k] = _mm512_load_si512(sums[k][t]);
      const float x_sum = C == Codes::kOffsets ? x_sums[t * blocks + b] : 0.f;
      add_digit_block<C>(acc[t], row, x.amax[t * blocks + b], x_sum, s, o);
    }
  };
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (C == Codes::kEightBit) prefetch_block<false>(g, b + kPrefetchBlocks);
    _tile_loadd(6, codes + b * kTileCodeBytes, kQuadBytes);
    _tile_loadd(3, x.digit(0, b, 0), x.row_bytes());
    _tile_loadd(4, x.digit(0, b, 1), x.row_bytes());
    _tile_loadd(5, x.digit(0, b, 2), x.row_bytes());
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    if constexpr (C == Codes::kOffsets) {  // signed digits by unsigned codes
      _tile_dpbsud(0, 3, 6);
      _tile_dpbsud(1, 4, 6);
      _tile_dpbsud(2, 5, 6);
    } else {  // by signed codes (8-bit; symmetric 4-bit codes less 8)
      _tile_dpbssd(0, 3, 6);
      _tile_dpbssd(1, 4, 6);
      _tile_dpbssd(2, 5, 6);
    }
    if (b > 0) scale_block(b - 1);
    _tile_stored(0, sums[0], kGroupRows * sizeof(int32_t));
    _tile_stored(1, sums[1], kGroupRows * sizeof(int32_t));
    _tile_stored(2, sums[2], kGroupRows * sizeof(int32_t));
  }
  if (blocks > 0) scale_block(blocks - 1);
  for (int64_t t = 0; t < T; ++t) store_lanes(out + t * out_stride, acc[t]);
}

// A group's codes as the tiles take them, every block: 8-bit codes as stored; 4-bit ones
// unpacked into [B, 8, 64] bytes, row j of a block the low nibbles of quad j, row 4 + j the high
// ones (less 8 where symmetric), in the calling thread's buffer.
template <Codes C, typename Scale>
const uint8_t* tile_codes(const Group<Scale>& g, int64_t blocks) {
  if constexpr (C == Codes::kEightBit) return g.values;
  thread_local std::vector<IVec> unpacked;
  unpacked.resize(blocks * 8);
  auto tile_code = [](IVec nibbles) {
    if constexpr (C == Codes::kSymmetric) return _mm512_sub_epi8(nibbles, _mm512_set1_epi8(8));
    return nibbles;
  };
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_block<true>(g, b + kPrefetchBlocks);
    for (int64_t j = 0; j < 4; ++j) {
      const IVec packed = load_codes(g.values + (b * 4 + j) * kQuadBytes);
      unpacked[b * 8 + j] = tile_code(low_nibbles(packed));
      unpacked[b * 8 + 4 + j] = tile_code(high_nibbles(packed));
    }
  }
  return reinterpret_cast<const uint8_t*>(unpacked.data());
}

template <Codes C, typename Scale, int64_t... T>
constexpr auto amx_kernels(std::integer_sequence<int64_t, T...>) {
  using Kernel = void (*)(const Group<Scale>&, const uint8_t*, const DigitRows&, const float*,
                          float*, int64_t);
  return std::array<Kernel, sizeof...(T)>{&amx_group_rows<C, Scale, T + 1>...};
}

// The groups [g0, g1) for every row, a tile of rows at a time (the tiles reshaped only where
// the rows of a tile change).
template <Codes C, typename Scale>
void amx_groups(const Groups<Scale>& weight, int64_t g0, int64_t g1, int64_t rows,
                const DigitRows& x, const float* x_sums, float* out, int64_t n) {
  static constexpr auto tiles =
      amx_kernels<C, Scale>(std::make_integer_sequence<int64_t, kAmxTileRows>{});
  int64_t shape = 0;  // the rows the tiles are configured for
  for (int64_t gi = g0; gi < g1; ++gi) {
    const Group<Scale> g = weight[gi];
    const uint8_t* codes = tile_codes<C>(g, x.blocks);
    for (int64_t r = 0; r < rows; r += kAmxTileRows) {
      const int64_t t = std::min(kAmxTileRows, rows - r);
      if (t != shape) configure_tiles(shape = t);
      const float* sums = C == Codes::kOffsets ? x_sums + r * x.blocks : nullptr;
      tiles[t - 1](g, codes, x.from_row(r), sums, out + r * n + gi * kGroupRows, n);
    }
  }
  _tile_release();  // the thread's tile state back to init: cheaper to switch out
}
#endif

template <Codes C, typename Scale>
void run_digits(const at::Tensor& x, const Jobs<Scale>& jobs, at::Tensor& out) {
  static constexpr auto tiles =
      digit_kernels<C, Scale>(std::make_integer_sequence<int64_t, kDigitTileRows>{});
  const int64_t n = out.size(1);
  const DigitRows xd = digit_rows(x, code_bias(C));
  const float* sums = C == Codes::kOffsets ? block_sums_of_x(x) : nullptr;  // the offsets'
  float* outp = out.data_ptr<float>();
  [[maybe_unused]] const bool tiles_granted = amx_tiles();
  const int64_t grain = groups_per_task(jobs.list[0].weight.group_bytes, 1);
  parallel_jobs(jobs, grain, [&](const Job<Scale>& job, int64_t g0, int64_t g1) {
    const int64_t r0 = job.row0, rows = job.rows;
    const float* job_sums = sums != nullptr ? sums + r0 * xd.blocks : nullptr;
#if defined(TANDEM_AMX_DIGITS)
    if (tiles_granted && rows >= amx_least_rows(four_bit(C)))
      return amx_groups<C>(job.weight, g0, g1, rows, xd.from_row(r0), job_sums, outp + r0 * n, n);
#endif
    for (int64_t gi = g0; gi < g1; ++gi)
      for (int64_t r = 0; r < rows; r += kDigitTileRows)
        tiles[std::min(kDigitTileRows, rows - r) - 1](
            job.weight[gi], xd.from_row(r0 + r),
            job_sums != nullptr ? job_sums + r * xd.blocks : nullptr,
            outp + (r0 + r) * n + gi * kGroupRows, n);
  });
}
#endif

}  // namespace

// Benchmarks and tests switch the tiles off to run the VNNI kernel on a machine that has both.
static std::atomic<bool> amx_wanted{true};

bool set_amx_tiles(bool use) { return amx_wanted.exchange(use); }

bool amx_tiles() {
#if defined(TANDEM_AMX_DIGITS)
  return amx_wanted.load(std::memory_order_relaxed) && amx_granted();
#else
  return false;
#endif
}

namespace {

// What the kernels need to know of a weight's tensors, checked once.
struct Format {
  bool words, four_bit, halves, symmetric, half;
};

// One weight's values, scales and offsets checked against the x_columns (K) of x [M, K]: their
// layout and which numerics they take (`quantized_linear`'s comment says which).
Format check_weight(int64_t x_columns, const at::Tensor& values, const at::Tensor& scales,
                    const at::Tensor& offsets) {
  // Words (int32) for float activations, quads (int8 or uint8 bytes) for int8 activations;
  // 4-bit codes in 4 runs of 64 bytes a block, 8-bit ones in 8.
  const bool words = values.scalar_type() == at::kInt;
  TORCH_CHECK(words || values.scalar_type() == at::kChar || values.scalar_type() == at::kByte,
              "values must be int32 (words), int8 or uint8 (quads)");
  const int64_t last = words ? kGroupRows : kQuadBytes;
  TORCH_CHECK(values.is_contiguous() && values.dim() == 4 && values.size(3) == last &&
                  (values.size(2) == 4 || values.size(2) == 8),
              "values must be [groups, blocks, 4 or 8, ", last, "]");
  const bool four_bit = values.size(2) == 4;
  TORCH_CHECK(words || four_bit == (values.scalar_type() == at::kByte),
              "quads are int8 for 8-bit codes, uint8 for 4-bit ones");
  const int64_t groups = values.size(0), blocks = values.size(1);
  TORCH_CHECK(x_columns == blocks * kBlockCols, "x has ", x_columns, " columns, the weight ",
              blocks * kBlockCols);
  const auto scale_type = scales.scalar_type();
  TORCH_CHECK(scale_type == at::kFloat || scale_type == at::kHalf, "scales must be float16/32");
  // 8-bit codes may have a scale per 16 columns (GGUF's Q6_K): a block's two sets side by side.
  const bool halves = !four_bit && scales.dim() == 3 && scales.size(2) == 2 * kGroupRows;
  const int64_t per_block = halves ? 2 * kGroupRows : kGroupRows;
  const bool shaped = scales.sizes() == at::IntArrayRef({groups, blocks, per_block});
  TORCH_CHECK(scales.is_contiguous() && shaped, "scales must be [groups, blocks, ", kGroupRows,
              "] (8-bit codes: or 2 x ", kGroupRows, ", a scale per 16 columns)");
  TORCH_CHECK(!halves || scale_type == at::kFloat, "a scale per 16 columns must be float32");
  // 4-bit weights have offsets, except symmetric ones; 8-bit ones none.
  TORCH_CHECK(four_bit || !present(offsets), "4-bit weights may have offsets, 8-bit ones none");
  TORCH_CHECK(!present(offsets) || (offsets.is_contiguous() && offsets.sizes() == scales.sizes() &&
                            offsets.scalar_type() == scale_type),
              "offsets must be shaped and typed as the scales");
  return {words, four_bit, halves, four_bit && !present(offsets), scale_type == at::kHalf};
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "x must be float32 [M, K] with contiguous rows");
}

// `count` weights stored back to back as jobs: weight w over rows [ends[w - 1], ends[w]) of x
// (from 0 for the first), weights without rows left out.
template <typename Scale>
Jobs<Scale> jobs_of(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& offsets,
                    const int64_t* ends, int64_t count) {
  const int64_t d = values.dim() - 4;  // 1 for a stack of weights, 0 for one
  Jobs<Scale> jobs{{}, values.size(d), values.size(d + 1)};
  for (int64_t w = 0, row0 = 0; w < count; row0 = ends[w++])
    if (ends[w] > row0)
      jobs.list.push_back(
          {row0, ends[w] - row0, groups_of<Scale>(values, scales, offsets, w, count)});
  return jobs;
}

// x against each weight of the stack (`jobs_of`), into out, in the numerics of `f`.
template <typename Scale>
void run_stack(const Format& f, const at::Tensor& x, const at::Tensor& values,
               const at::Tensor& scales, const at::Tensor& offsets, const int64_t* ends,
               int64_t count, at::Tensor& out) {
  const Jobs<Scale> jobs = jobs_of<Scale>(values, scales, offsets, ends, count);
  if (jobs.list.empty()) return;
  constexpr bool kHalf = std::is_same_v<Scale, c10::Half>;
  // 8-bit codes meet the digits only where AMX tiles run them: on VNNI alone a code widens for
  // an FMA about as fast (experiments.md), and every row count of a setting takes one numerics.
  // Codes with a scale per 16 columns always widen: the tiles' products span a block.
  [[maybe_unused]] const bool eight_bit_digits = !f.four_bit && !f.halves && amx_tiles();
  if (!f.words && f.symmetric) run_integer<true, true, false, Scale>(x, jobs, out);
  else if (!f.words && f.four_bit) run_integer<true, false, false, Scale>(x, jobs, out);
  else if (!f.words && f.halves) {
    if constexpr (!kHalf) run_integer<false, false, true, Scale>(x, jobs, out);
  } else if (!f.words) run_integer<false, false, false, Scale>(x, jobs, out);
#if defined(TANDEM_DIGIT_PRODUCTS)
  else if (f.symmetric) run_digits<Codes::kSymmetric, Scale>(x, jobs, out);
  else if (f.four_bit) run_digits<Codes::kOffsets, Scale>(x, jobs, out);
  else if (eight_bit_digits) run_digits<Codes::kEightBit, Scale>(x, jobs, out);
#else
  else if (f.four_bit) run<true, false, Scale>(x, jobs, out);
#endif
  else if (f.halves) {
    if constexpr (!kHalf) run<false, true, Scale>(x, jobs, out);
  } else run<false, false, Scale>(x, jobs, out);
}

void run_stack(const Format& f, const at::Tensor& x, const at::Tensor& values,
               const at::Tensor& scales, const at::Tensor& offsets, const int64_t* ends,
               int64_t count, at::Tensor& out) {
  if (f.half) run_stack<c10::Half>(f, x, values, scales, offsets, ends, count, out);
  else run_stack<float>(f, x, values, scales, offsets, ends, count, out);
}

// Rows `ids` of a weight in its blocks as float32, each value code * scale, then + offset: two
// roundings, as ops/quantized.py's dequantize makes them. GCC may contract the two into one FMA
// (its default -ffp-contract=fast), which would change a lookup's last bit: not here.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rows_of_blocks(const Format& f, const at::Tensor& values, const at::Tensor& scales,
                    const at::Tensor& offsets, const int64_t* ids, int64_t count, float* out) {
  const int64_t blocks = values.size(1), cols = blocks * kBlockCols;
  const int64_t runs = f.four_bit ? 4 : 8;
  const int64_t per_block = f.halves ? 2 * kGroupRows : kGroupRows;
  const auto* bytes = static_cast<const uint8_t*>(values.data_ptr());
  const void* scale_data = scales.data_ptr();
  const void* offset_data = present(offsets) ? offsets.data_ptr() : nullptr;
  const auto read = [&](const void* p, int64_t i) {
    return f.half ? float(static_cast<const c10::Half*>(p)[i]) : static_cast<const float*>(p)[i];
  };
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    float codes[kBlockCols];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = ids[t] / kGroupRows, n = ids[t] % kGroupRows;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = bytes + (g * blocks + b) * runs * kQuadBytes;
        for (int64_t j = 0; j < runs; ++j) {
          for (int64_t c = 0; c < 4; ++c) {
            const uint8_t byte = block[j * kQuadBytes + 4 * n + c];
            if (f.four_bit) {  // the low nibble is column 4j + c, the high one 16 + 4j + c
              codes[4 * j + c] = float(byte & 15);
              codes[16 + 4 * j + c] = float(byte >> 4);
            } else {
              codes[4 * j + c] = float(static_cast<int8_t>(byte));
            }
          }
        }
        const int64_t s = (g * blocks + b) * per_block + n;
        const float first = read(scale_data, s);
        const float last = f.halves ? read(scale_data, s + kGroupRows) : first;
        float offset = 0.0f;
        if (f.symmetric) offset = first * -8.0f;
        else if (offset_data) offset = read(offset_data, s);
        float* w = out + t * cols + b * kBlockCols;
        for (int64_t k = 0; k < kBlockCols; ++k) {
          const float product = codes[k] * (k < kBlockCols / 2 ? first : last);
          w[k] = f.four_bit ? product + offset : product;
        }
      }
    }
  });
}
#pragma GCC pop_options

}  // namespace

at::Tensor quantized_rows(const at::Tensor& values, const at::Tensor& scales,
                          const at::Tensor& offsets, const at::Tensor& ids) {
  const int64_t rows = values.size(0) * kGroupRows;
  const Format f = check_weight(values.size(1) * kBlockCols, values, scales, offsets);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be int64 [T]");
  const auto index = ids.contiguous();
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t t = 0; t < index.numel(); ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "row ", id[t], " outside the weight's ", rows);
  auto out = at::empty({index.numel(), values.size(1) * kBlockCols}, at::kFloat);
  rows_of_blocks(f, values, scales, offsets, id, index.numel(), out.data_ptr<float>());
  return out;
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                            const at::Tensor& offsets, const at::Tensor& bias) {
  check_x(x);
  const Format f = check_weight(x.size(1), values, scales, offsets);
  const int64_t n = values.size(0) * kGroupRows;
  TORCH_CHECK(!present(bias) || (bias.scalar_type() == at::kFloat && bias.numel() == n),
              "bias must be float32 [", n, "]");
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  const int64_t rows = x.size(0);
  run_stack(f, x, values, scales, offsets, &rows, 1, out);
  if (present(bias)) out.add_(bias);
  return out;
}

at::Tensor quantized_experts(const at::Tensor& x, const at::Tensor& row_ends,
                             const at::Tensor& values, const at::Tensor& scales,
                             const at::Tensor& offsets) {
  check_x(x);
  TORCH_CHECK(values.dim() == 5 && values.is_contiguous() && scales.is_contiguous() &&
                  scales.dim() == 4 && scales.size(0) == values.size(0) &&
                  (!present(offsets) || (offsets.dim() == 4 && offsets.is_contiguous())),
              "values must be [experts, groups, blocks, runs, lanes], scales and offsets "
              "[experts, groups, blocks, scales], contiguous");
  const at::Tensor none;
  const Format f =
      check_weight(x.size(1), values[0], scales[0], present(offsets) ? offsets[0] : none);
  const int64_t experts = values.size(0);
  const int64_t* ends = expert_row_ends(row_ends, experts, x.size(0));
  auto out = at::empty({x.size(0), values.size(1) * kGroupRows}, x.options());
  if (x.size(0) > 0) run_stack(f, x, values, scales, offsets, ends, experts, out);
  return out;
}

}  // namespace tandem
