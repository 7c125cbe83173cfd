// Linear layers over quantized weights (GGUF's Q8_0, Q4_0, Q4_1, Q4_K; per-channel int8),
// multiplied in float32 with the weights dequantized in registers.
//
// Layout (tandem/ops/quantized.py packs it): the N output rows in groups of 16, the K inputs in
// blocks of 32. For group g and block b:
//   8-bit  values int8  [G, B, 32, 16]: values[g, b, i, n] is the code of row 16g+n, column 32b+i
//   4-bit  values uint8 [G, B, 16, 16]: the low nibble is column 32b+i, the high one 32b+i+16
//   scales [G, B, 16] float16 or float32; offsets (4-bit) alike: weight = code * scale + offset
// So one column of a block is the 16 rows' weights in adjacent lanes, and the product is a sum
// of outer products (x broadcast, weights as vectors): no reduction across lanes, every weight
// byte read once, in order. Each weight is exactly the float32 a dequantized copy holds (code *
// scale is exact, + offset rounds once as llama.cpp's dequantization does), and every output is
// summed in the same order whatever the number of rows, so a row's result does not depend on
// the batch it is in.

#include "vectors.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>

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

inline Column widen_i8(const int8_t* p) {
  Column c;
#if defined(__AVX512F__)
  c[0] = (VecL)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  c[0] = (VecL)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  c[1] = (VecL)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
#else
  for (int64_t v = 0; v < kVectors; ++v)
    for (int64_t l = 0; l < kLanes; ++l) c[v][l] = p[v * kLanes + l];
#endif
  return c;
}

// 16 bytes of nibbles -> the low nibbles' column and the high nibbles' column.
inline void widen_nibbles(const uint8_t* p, Column& lo, Column& hi) {
#if defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(0x0F);
  const __m128i l = _mm_and_si128(bytes, mask), h = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
#if defined(__AVX512F__)
  lo[0] = (VecL)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(l));
  hi[0] = (VecL)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h));
#else
  lo[0] = (VecL)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l));
  lo[1] = (VecL)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(l, l)));
  hi[0] = (VecL)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h));
  hi[1] = (VecL)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(h, h)));
#endif
#else
  for (int64_t v = 0; v < kVectors; ++v)
    for (int64_t l = 0; l < kLanes; ++l) {
      lo[v][l] = p[v * kLanes + l] & 15;
      hi[v][l] = p[v * kLanes + l] >> 4;
    }
#endif
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

// Calls f(j, column) for the 32 columns of block b, in the order every kernel sums them
// (j: the column within the block).
template <bool kFourBit, typename Scale, typename F>
inline void for_each_column(const Group<Scale>& g, int64_t b, F&& f) {
  const Column s = load_scales(g.scales + b * kGroupRows);
  if constexpr (kFourBit) {
    const Column o = load_scales(g.offsets + b * kGroupRows);
    const uint8_t* q = g.values + b * (kBlockCols / 2) * kGroupRows;
    for (int64_t i = 0; i < kBlockCols / 2; ++i) {
      Column lo, hi;
      widen_nibbles(q + i * kGroupRows, lo, hi);
      for (int64_t v = 0; v < kVectors; ++v) {
        lo[v] = lo[v] * s[v] + o[v];
        hi[v] = hi[v] * s[v] + o[v];
      }
      f(i, lo);
      f(i + kBlockCols / 2, hi);
    }
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(g.values) + b * kBlockCols * kGroupRows;
    for (int64_t i = 0; i < kBlockCols; ++i) {
      Column w = widen_i8(q + i * kGroupRows);
      for (int64_t v = 0; v < kVectors; ++v) w[v] *= s[v];
      f(i, w);
    }
  }
}

// T rows of x (T <= kTileRows) against one group: the accumulators stay in registers.
template <bool kFourBit, typename Scale, int64_t T>
void group_in_registers(const Group<Scale>& g, int64_t blocks, const float* x, int64_t x_stride,
                        float* out, int64_t out_stride) {
  Column acc[T] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlockCols;
    for_each_column<kFourBit>(g, b, [&](int64_t j, const Column& w) {
      for (int64_t t = 0; t < T; ++t) {
        const float xv = xb[t * x_stride + j];
        for (int64_t v = 0; v < kVectors; ++v) acc[t][v] += xv * w[v];
      }
    });
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < kVectors; ++v) store_lanes(out + t * out_stride + v * kLanes, acc[t][v]);
}

// T rows of x against a block already dequantized into w (its columns in summation order),
// accumulating into out.
template <int64_t T>
void tile_from_buffer(const float* w, const int64_t* order, const float* x, int64_t x_stride,
                      float* out, int64_t out_stride) {
  Column acc[T];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < kVectors; ++v) acc[t][v] = load_lanes(out + t * out_stride + v * kLanes);
  for (int64_t c = 0; c < kBlockCols; ++c) {
    const int64_t j = order[c];
    Column wc;
    for (int64_t v = 0; v < kVectors; ++v) wc[v] = load_lanes(w + c * kGroupRows + v * kLanes);
    for (int64_t t = 0; t < T; ++t) {
      const float xv = x[t * x_stride + j];
      for (int64_t v = 0; v < kVectors; ++v) acc[t][v] += xv * wc[v];
    }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < kVectors; ++v) store_lanes(out + t * out_stride + v * kLanes, acc[t][v]);
}

template <int64_t... T>
constexpr auto tile_kernels(std::integer_sequence<int64_t, T...>) {
  using Kernel = void (*)(const float*, const int64_t*, const float*, int64_t, float*, int64_t);
  return std::array<Kernel, sizeof...(T)>{&tile_from_buffer<T + 1>...};
}

template <bool kFourBit, typename Scale, int64_t... T>
constexpr auto register_kernels(std::integer_sequence<int64_t, T...>) {
  using Kernel = void (*)(const Group<Scale>&, int64_t, const float*, int64_t, float*, int64_t);
  return std::array<Kernel, sizeof...(T)>{&group_in_registers<kFourBit, Scale, T + 1>...};
}

// More rows than a tile: each block is dequantized once into a buffer that every tile reads.
template <bool kFourBit, typename Scale>
void group_through_buffer(const Group<Scale>& g, int64_t blocks, const float* x, int64_t x_stride,
                          int64_t rows, float* out, int64_t out_stride) {
  static constexpr auto tiles = tile_kernels(std::make_integer_sequence<int64_t, kTileRows>{});
  alignas(64) float w[kBlockCols * kGroupRows];
  int64_t order[kBlockCols];
  for (int64_t t = 0; t < rows; ++t) std::fill_n(out + t * out_stride, kGroupRows, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t c = 0;
    for_each_column<kFourBit>(g, b, [&](int64_t j, const Column& col) {
      order[c] = j;
      for (int64_t v = 0; v < kVectors; ++v) store_lanes(w + c * kGroupRows + v * kLanes, col[v]);
      ++c;
    });
    for (int64_t t = 0; t < rows; t += kTileRows) {
      const int64_t n = std::min(kTileRows, rows - t);
      tiles[n - 1](w, order, x + t * x_stride + b * kBlockCols, x_stride, out + t * out_stride,
                   out_stride);
    }
  }
}

template <bool kFourBit, typename Scale>
void run(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
         const at::Tensor& offsets, at::Tensor& out) {
  static constexpr auto in_registers =
      register_kernels<kFourBit, Scale>(std::make_integer_sequence<int64_t, kTileRows>{});
  const int64_t rows = x.size(0), x_stride = x.stride(0), groups = values.size(0);
  const int64_t blocks = values.size(1), n = out.size(1);
  const auto* vp = static_cast<const uint8_t*>(values.data_ptr());
  const auto* sp = static_cast<const Scale*>(scales.data_ptr());
  const auto* op = kFourBit ? static_cast<const Scale*>(offsets.data_ptr()) : nullptr;
  const int64_t group_bytes = values.stride(0), group_scales = scales.stride(0);
  const float* xp = x.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  // At least ~64 KiB of weights per task: smaller tasks cost more to hand out than they save.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(group_bytes, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t m0 = 0; m0 < rows; m0 += kChunkRows) {
      const int64_t m = std::min(kChunkRows, rows - m0);
      for (int64_t gi = g0; gi < g1; ++gi) {
        const Group<Scale> g{vp + gi * group_bytes, sp + gi * group_scales,
                             kFourBit ? op + gi * group_scales : nullptr};
        float* o = outp + m0 * n + gi * kGroupRows;
        const float* xm = xp + m0 * x_stride;
        if (m <= kTileRows) in_registers[m - 1](g, blocks, xm, x_stride, o, n);
        else group_through_buffer<kFourBit>(g, blocks, xm, x_stride, m, o, n);
      }
    }
  });
}

}  // namespace

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                            const at::Tensor& offsets, const at::Tensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "x must be float32 [M, K] with contiguous rows");
  const bool four_bit = values.scalar_type() == at::kByte;
  TORCH_CHECK(four_bit || values.scalar_type() == at::kChar, "values must be int8 or uint8");
  TORCH_CHECK(values.is_contiguous() && values.dim() == 4 && values.size(3) == kGroupRows &&
                  values.size(2) == (four_bit ? kBlockCols / 2 : kBlockCols),
              "values must be [groups, blocks, ", four_bit ? kBlockCols / 2 : kBlockCols, ", ",
              kGroupRows, "]");
  const int64_t groups = values.size(0), blocks = values.size(1);
  TORCH_CHECK(x.size(1) == blocks * kBlockCols, "x has ", x.size(1), " columns, the weight ",
              blocks * kBlockCols);
  const auto scale_type = scales.scalar_type();
  TORCH_CHECK(scale_type == at::kFloat || scale_type == at::kHalf, "scales must be float16/32");
  TORCH_CHECK(scales.is_contiguous() && scales.sizes() == at::IntArrayRef({groups, blocks, kGroupRows}),
              "scales must be [groups, blocks, ", kGroupRows, "]");
  TORCH_CHECK(four_bit == present(offsets), "4-bit weights have offsets, 8-bit ones none");
  TORCH_CHECK(!four_bit || (offsets.is_contiguous() && offsets.sizes() == scales.sizes() &&
                            offsets.scalar_type() == scale_type),
              "offsets must be shaped and typed as the scales");
  const int64_t n = groups * kGroupRows;
  TORCH_CHECK(!present(bias) || (bias.scalar_type() == at::kFloat && bias.numel() == n),
              "bias must be float32 [", n, "]");
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  if (four_bit && scale_type == at::kHalf) run<true, c10::Half>(x, values, scales, offsets, out);
  else if (four_bit) run<true, float>(x, values, scales, offsets, out);
  else if (scale_type == at::kHalf) run<false, c10::Half>(x, values, scales, offsets, out);
  else run<false, float>(x, values, scales, offsets, out);
  if (present(bias)) out.add_(bias);
  return out;
}

}  // namespace tandem
