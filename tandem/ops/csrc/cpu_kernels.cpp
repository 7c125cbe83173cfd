// Fused CPU kernels for the forward pass (float32), registered as torch.ops.tandem.*.
//
// Why they exist: on a CPU the eager forward spends its time in many small ops (norms, rotary,
// activation: several passes over memory and a dispatch each) and, for decode attention, in
// copying every request's whole context out of the paged cache before attending to it. These
// kernels make one pass each, and the decode attention reads the paged cache in place.
//
// Every kernel takes tensors whose last dimension is contiguous; a row stride is honoured so
// that views of a fused projection (q, k, v of one qkv matmul) need no copy.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIndexing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/types.h>

#include "experts.h"
#include "tasks.h"
#include "vectors.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <latch>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace tandem;

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have a contiguous last dimension");
}

// A KV cache of one byte a value (tandem/ops/kv_quant.py, the contract): each (token, kv head)
// row is head_dim int8 codes, then a float32 scale per block of kInt8Block values along the head
// (the last block shorter where head_dim is not a multiple of it).
constexpr int64_t kScaleBytes = 4;
constexpr int64_t kInt8Block = 32;
constexpr float kInt8Max = 127.f;

// An int8 row's elements: `dim` codes and its blocks' scales.
constexpr int64_t int8_row(int64_t dim) {
  return dim + kScaleBytes * ((dim + kInt8Block - 1) / kInt8Block);
}

// A cache of float32 values, or of int8 rows of codes and scales, `dim` values a kv head.
void check_cache(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kChar, name,
              " must be float32, or int8 codes and scales");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  const int64_t width = t.scalar_type() == at::kChar ? int8_row(dim) : dim;
  TORCH_CHECK(t.size(-1) == width, name, " rows must hold ", width, " values");
}

// The scale of block `b` of an int8 row of `dim` codes.
inline float block_scale(const int8_t* row, int64_t dim, int64_t b) {
  float scale;
  std::memcpy(&scale, row + dim + b * kScaleBytes, sizeof(scale));
  return scale;
}

// One row of `dim` values as the cache holds it: kv_quant.quantize's rule bit for bit, block by
// block (scale = max|x| / 127 over the block; code = x / scale rounded half to even, in
// [-127, 127]; 0 where the scale is), the scales after the codes.
inline void quantize_row(const float* x, int64_t dim, int8_t* out) {
  for (int64_t b0 = 0; b0 < dim; b0 += kInt8Block) {
    const int64_t b1 = std::min(dim, b0 + kInt8Block);
    float amax = 0.f;
    for (int64_t d = b0; d < b1; ++d) amax = std::max(amax, std::abs(x[d]));
    const float scale = amax / kInt8Max;
    for (int64_t d = b0; d < b1; ++d) {
      const float code = scale > 0.f ? std::nearbyint(x[d] / scale) : 0.f;
      out[d] = static_cast<int8_t>(std::clamp(code, -kInt8Max, kInt8Max));
    }
    std::memcpy(out + dim + b0 / kInt8Block * kScaleBytes, &scale, sizeof(scale));
  }
}

// An int8 row's values: each code times its block's scale (kv_quant.dequantize's arithmetic).
inline void dequantize_row(const int8_t* row, int64_t dim, float* out) {
  for (int64_t b0 = 0; b0 < dim; b0 += kInt8Block) {
    const float scale = block_scale(row, dim, b0 / kInt8Block);
    const int64_t b1 = std::min(dim, b0 + kInt8Block);
    for (int64_t d = b0; d < b1; ++d) out[d] = static_cast<float>(row[d]) * scale;
  }
}

// The clamp and the 2^n of fast_exp, for a float and for a vector of kLanes floats: the same
// comparisons and bit operations lane by lane, so both give the same bits.
inline float clamp_to(float x, float lo, float hi) { return std::min(std::max(x, lo), hi); }
inline VecL clamp_to(VecL x, float lo, float hi) {
  x = x < lo ? VecL{} + lo : x;  // std::max(x, lo)
  return hi < x ? VecL{} + hi : x;  // std::min(x, hi)
}
// 2^n for `shifted` = n + 1.5 * 2^23 (n in its low mantissa bits): n + 127 in the exponent field.
inline float exponent_scale(float shifted) {
  int32_t rounded;
  std::memcpy(&rounded, &shifted, sizeof(rounded));
  const int32_t bits = (rounded - 0x4B400000 + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale;
}
inline VecL exponent_scale(VecL shifted) {
  return reinterpret_cast<VecL>((reinterpret_cast<LanesL>(shifted) - 0x4B400000 + 127) << 23);
}

// exp(x) in a form the compiler vectorises (libm's expf is a scalar call): 2^n * e^f with
// Cody-Waite range reduction and Cephes' degree-6 polynomial, within a few ulp of expf. F is
// float (in loops GCC vectorises) or VecL (explicit vectors, where it does not: the AVX2 build
// left the decode attention's exponentials scalar).
template <typename F>
__attribute__((always_inline)) inline F fast_exp(F x) {
  x = clamp_to(x, -87.3f, 88.7f);
  // Adding 1.5 * 2^23 rounds to the nearest integer and leaves it in the low mantissa bits
  // (std::floor would keep the loop from vectorising without -ffast-math).
  const F shifted = x * 1.44269504088896341f + 12582912.f;
  const F n = shifted - 12582912.f;
  const F f = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = 1.9875691500e-4f + F{};
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.f;
  return p * exponent_scale(shifted);
}

// Rows per task such that a task touches at least ~32K floats: below that, waking another
// thread costs more than it saves (ATen uses the same grain for its elementwise ops).
inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

inline float sum_of_squares(const float* x, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += x[i] * x[i];
  return acc;
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), row by row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_rows(x, "x");
  auto x2 = x.reshape({-1, x.size(-1)});
  auto out = at::empty_like(x2, at::MemoryFormat::Contiguous);
  const int64_t rows = x2.size(0), cols = x2.size(1), stride = x2.stride(0);
  const float* xp = x2.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * stride;
      float* orow = op + r * cols;
      const float inv = 1.f / std::sqrt(sum_of_squares(xr, cols) / cols + (float)eps);
#pragma omp simd
      for (int64_t i = 0; i < cols; ++i) orow[i] = wp[i] * (xr[i] * inv);
    }
  });
  return out.view(x.sizes());
}

// residual += x; returns weight * rms_normalised(residual). residual is updated in place.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  check_float_rows(x, "x");
  check_float_rows(residual, "residual");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(),
              "residual must be contiguous and shaped like x");
  auto out = at::empty_like(residual);
  const int64_t cols = x.size(-1), rows = x.numel() / cols, stride = x.stride(-2);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * stride;
      float* rr = rp + r * cols;
#pragma omp simd
      for (int64_t i = 0; i < cols; ++i) rr[i] = rr[i] + xr[i];
      const float inv = 1.f / std::sqrt(sum_of_squares(rr, cols) / cols + (float)eps);
      float* orow = op + r * cols;
#pragma omp simd
      for (int64_t i = 0; i < cols; ++i) orow[i] = wp[i] * (rr[i] * inv);
    }
  });
  return out;
}

// Neox-style rotary embedding, in place: x [T, heads, D] with any token stride.
// cos / sin [max_pos, D] hold the (scaled) tables with both halves, as Hugging Face builds them.
void rotary_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(1) == x.size(2), "x must be [T, heads, D], heads packed");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t stride = x.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * dim;
      const float* s = sp + pos[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + t * stride + h * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] - b * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// Each token's K and V rows ([T, kv_heads, D], any token stride) into their cache slots (the
// caches contiguous, a slot every kv_heads rows: [blocks, block_size, kv_heads, D]), as
// `index_copy_` along the slots would; into an int8 cache (int8_row(D) wide) as codes and scales
// (quantize_row). Why: a decode step writes one row per layer, and index_copy_'s generic path
// cost more than the copy itself.
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_float_rows(k, "k");
  check_float_rows(v, "v");
  TORCH_CHECK(k.dim() == 3 && k.stride(1) == k.size(2) && v.sizes() == k.sizes() &&
                  v.stride(1) == v.size(2),
              "k and v must be [T, kv_heads, D] alike, heads packed");
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  check_cache(k_cache, "k_cache", dim);
  check_cache(v_cache, "v_cache", dim);
  const bool codes = k_cache.scalar_type() == at::kChar;
  const int64_t width = k_cache.size(-1), row = heads * width;  // a slot, in cache elements
  const int64_t slots = row > 0 ? k_cache.numel() / row : 0;
  TORCH_CHECK(k_cache.numel() == slots * row && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must be alike, in slots of kv_heads rows");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens,
              "slot_mapping must be int64, one slot per token");
  const at::Tensor slots_held = slot_mapping.contiguous();
  const int64_t* slot = slots_held.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " is outside the cache");
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  if (codes) {
    int8_t* kc = k_cache.data_ptr<int8_t>();
    int8_t* vc = v_cache.data_ptr<int8_t>();
    at::parallel_for(0, tokens, grain_rows(2 * heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          quantize_row(kp + t * ks + h * dim, dim, kc + slot[t] * row + h * width);
          quantize_row(vp + t * vs + h * dim, dim, vc + slot[t] * row + h * width);
        }
      }
    });
    return;
  }
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  at::parallel_for(0, tokens, grain_rows(2 * row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slot[t] * row, kp + t * ks, row * sizeof(float));
      std::memcpy(vc + slot[t] * row, vp + t * vs, row * sizeof(float));
    }
  });
}

// [T, 2I] -> [T, I]: silu(gate) * up, the Llama MLP's activation in one pass.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_float_rows(x, "x");
  const int64_t rows = x.size(0), inter = x.size(1) / 2, stride = x.stride(0);
  auto out = at::empty({rows, inter}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(inter * 8), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = xp + r * stride;
      const float* u = g + inter;
      float* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
    }
  });
  return out;
}

// Softmax's numerators in place: s[i] = exp(s[i] - max(s)); returns 1 / their sum.
inline float exp_scores(float* s, int64_t n) {
  // The max in 16 independent lanes: a single running max is a chain of dependent scalar
  // compares (GCC does not vectorise that reduction), which dominated this function's profile.
  float lanes[16];
  std::fill(lanes, lanes + 16, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int64_t l = 0; l < 16; ++l) lanes[l] = std::max(lanes[l], s[i + l]);
  for (; i < n; ++i) lanes[0] = std::max(lanes[0], s[i]);
  const float m = *std::max_element(lanes, lanes + 16);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = fast_exp(s[i] - m);
    total += s[i];
  }
  return 1.f / total;
}

// Decode queries against their paged K/V, read in place through the block tables.
//   q [N, H, D] (any row stride), caches [blocks, block_size, Hkv, D] contiguous, out [N, H, D]
//   contiguous. An int8 cache's rows (codes, then a scale per block of 32) are dequantized in
//   registers: a score sums each block's (q . codes) * scale, and a V row's blocks are scaled.
// Queries come in runs: `queries` consecutive rows of one request at consecutive positions,
// query i seeing the first len - (queries - 1 - i) tokens of the run's blocks. A decode is a run
// of one; a verification's k + 1 rows, or a short chunk after a cached context, a longer one,
// whose K/V rows are then read once for all its queries instead of once per query.
struct QueryRun {
  int64_t row;  // its first query's row of q and out
  int64_t queries;
  const int64_t* blocks;  // its block table row
  int64_t len;  // the context its last query sees

  int64_t len_of(int64_t i) const { return len - (queries - 1 - i); }
};

struct DecodeProblem {
  const float* q;
  const void* k;  // float32 values, or int8 codes and scales
  const void* v;
  float* out;
  int64_t heads, kv_heads, group, block_size, q_stride, sliding_window;
  float scale;

  // Where the window starts for a query that sees `len` tokens (0 without a window).
  int64_t first_of(int64_t len) const {
    return sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
  }
};

// A cache's elements per kv head's row: its values, and an int8 row's scale bytes.
template <typename T>
constexpr int64_t head_row(int64_t dim) {
  return std::is_same_v<T, int8_t> ? int8_row(dim) : dim;
}

// Query i of `run`, its query heads of kv heads [h0, h1), over a cache of T (float or int8_t).
// DIM > 0 fixes the head size at compile time (unrolled dot products); 0 reads it from `dim`.
// Taking several kv heads at once uses every byte of each cache line a token's K/V row spans
// (heads are interleaved per token).
template <typename T, int64_t DIM>
void attend(const DecodeProblem& p, const QueryRun& run, int64_t i, int64_t h0, int64_t h1,
            int64_t dim, std::vector<float>& scores, std::vector<float>& acc) {
  constexpr bool kCodes = std::is_same_v<T, int8_t>;
  const int64_t D = DIM > 0 ? DIM : dim, R = head_row<T>(D);
  const int64_t G = p.group, token_stride = p.kv_heads * R, nh = (h1 - h0) * G;
  const int64_t len = run.len_of(i), first = p.first_of(len), n = len - first;
  scores.resize(nh * n);
  acc.assign(nh * D, 0.f);
  const float* qr = p.q + (run.row + i) * p.q_stride + h0 * G * D;  // nh query heads, D apart
  // Rows of K (then V) are visited block by block, each row serving every query head it feeds.
  auto for_each_row = [&](const void* cache, auto&& body) {
    for (int64_t b = first / p.block_size; b * p.block_size < len; ++b) {
      const int64_t t0 = b * p.block_size;
      const int64_t lo = std::max(first, t0) - t0, hi = std::min(len - t0, p.block_size);
      const T* base =
          static_cast<const T*>(cache) + (run.blocks[b] * p.block_size) * token_stride + h0 * R;
      for (int64_t o = lo; o < hi; ++o) body(t0 + o - first, base + o * token_stride);
    }
  };
  for_each_row(p.k, [&](int64_t t, const T* row) {
    for (int64_t j = 0; j < nh; ++j) {  // query head j reads kv head j / G of this row
      const float* qj = qr + j * D;
      const T* kj = row + (j / G) * R;
      float s = 0.f;
      if constexpr (kCodes) {
        for (int64_t b0 = 0; b0 < D; b0 += kInt8Block) {
          const int64_t b1 = std::min(D, b0 + kInt8Block);
          float part = 0.f;
#pragma omp simd reduction(+ : part)
          for (int64_t d = b0; d < b1; ++d) part += qj[d] * kj[d];
          s += part * block_scale(kj, D, b0 / kInt8Block);
        }
      } else {
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qj[d] * kj[d];
      }
      scores[j * n + t] = s * p.scale;
    }
  });
  std::vector<float> inv_sums(nh);
  for (int64_t j = 0; j < nh; ++j) inv_sums[j] = exp_scores(scores.data() + j * n, n);
  for_each_row(p.v, [&](int64_t t, const T* row) {
    for (int64_t j = 0; j < nh; ++j) {
      const T* vj = row + (j / G) * R;
      const float w = scores[j * n + t];
      float* a = acc.data() + j * D;
      if constexpr (kCodes) {
        for (int64_t b0 = 0; b0 < D; b0 += kInt8Block) {
          const int64_t b1 = std::min(D, b0 + kInt8Block);
          const float wb = w * block_scale(vj, D, b0 / kInt8Block);
#pragma omp simd
          for (int64_t d = b0; d < b1; ++d) a[d] += wb * vj[d];
        }
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * vj[d];
      }
    }
  });
  for (int64_t j = 0; j < nh; ++j) {
    float* o = p.out + ((run.row + i) * p.heads + h0 * G + j) * D;
    const float* a = acc.data() + j * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv_sums[j];
  }
}

// The same attention with explicit vectors of one register each (GCC vector extensions), for
// head sizes that are multiples of the width and common group sizes. Why: the generic loop above
// reduces every dot product across its lanes on its own and keeps its sums in memory. Here a kv
// head's G queries stay in registers, scores are made kLanes tokens at a time (kLanes
// lane-vectors reduced together by a shuffle tree instead of kLanes full reductions) and the
// weighted sum of V accumulates in registers (nearly twice the generic loop's speed with the
// cache in CPU caches).
using Vec16 = float __attribute__((vector_size(64)));
using Lanes16 = int32_t __attribute__((vector_size(64)));
using Vec16Unaligned = float __attribute__((vector_size(64), aligned(4), may_alias));

inline Vec16 load16(const float* p) { return *reinterpret_cast<const Vec16Unaligned*>(p); }

constexpr int64_t kLineFloats = kCacheLineBytes / sizeof(float);

// kLanes int8 codes as floats (exact): a sign extension and a conversion per vector. In
// intrinsics: GCC turns the same `__builtin_convertvector` into a scalar load and conversion
// per lane, which made the int8 kernel slower than the float one.
inline VecL load_codes(const int8_t* p) {
  const auto* codes = reinterpret_cast<const __m128i*>(p);
#ifdef __AVX512F__
  return reinterpret_cast<VecL>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes))));
#else
  return reinterpret_cast<VecL>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(codes))));
#endif
}

// Lane t of the result is the sum of the kLanes lanes of v[t]. Each level adds the two halves of
// every token's partial sums, packing two vectors' tokens into one, in order. (A mask indexes
// the two vectors side by side: lane i of the second is kLanes + i.)
inline VecL sum_lanes(VecL v[kLanes]) {
  auto level = [](VecL* x, int pairs, LanesL lo, LanesL hi) {
    for (int i = 0; i < pairs; ++i) {
      x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo) +
             __builtin_shuffle(x[2 * i], x[2 * i + 1], hi);
    }
  };
#ifdef __AVX512F__
  level(v, 8, LanesL{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
        LanesL{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  level(v, 4, LanesL{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
        LanesL{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  level(v, 2, LanesL{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
        LanesL{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  level(v, 1, LanesL{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
        LanesL{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
#else
  level(v, 4, LanesL{0, 1, 2, 3, 8, 9, 10, 11}, LanesL{4, 5, 6, 7, 12, 13, 14, 15});
  level(v, 2, LanesL{0, 1, 4, 5, 8, 9, 12, 13}, LanesL{2, 3, 6, 7, 10, 11, 14, 15});
  level(v, 1, LanesL{0, 2, 4, 6, 8, 10, 12, 14}, LanesL{1, 3, 5, 7, 9, 11, 13, 15});
#endif
  return v[0];
}

// Walks one request's K (or V) rows, cache line by cache line, ahead of the kernel that reads
// them: the software prefetch of paged attention, where blocks may lie anywhere in the cache.
struct LinePrefetcher {
  const float* cache;
  const int64_t* blocks;
  int64_t block_size, token_stride, offset, len, lines_per_row;
  int64_t block = 0, row = 0, line = 0;  // the next line to prefetch

  // Restart at `token` of `cache_start` and run `lines` ahead.
  void start(const float* cache_start, int64_t token, int64_t lines) {
    cache = cache_start;
    block = token / block_size;
    row = token % block_size;
    line = 0;
    ahead(lines);
  }
  // Prefetch the next `lines` lines (into L2), stopping at the context's end.
  inline void ahead(int64_t lines) {
    for (int64_t i = 0; i < lines; ++i) {
      if (block * block_size + row >= len) return;
      const float* at = cache + (blocks[block] * block_size + row) * token_stride + offset;
      __builtin_prefetch(at + line * kLineFloats, 0, 1);
      if (++line == lines_per_row) {
        line = 0;
        if (++row == block_size) {
          row = 0;
          ++block;
        }
      }
    }
  }
};

// The same walk over an int8 cache, a row at a time: its rows (int8_row(D) bytes a kv head)
// start anywhere in a line, so each row asks for the one to three lines it spans. Calls give
// parts of a row (`ahead(parts)`, `cost` parts a row), so that a pass's calls keep pace with its
// reads.
// Why rows: counted line by line, the walk's bookkeeping was a third of the int8 kernel's
// instructions.
struct RowPrefetcher {
  const int8_t* cache;
  const int64_t* blocks;
  int64_t block_size, token_stride, offset, row_bytes, len;
  int64_t block = 0, row = 0, credit = 0, cost = 1;  // the next row; parts given, a row's parts

  // Restart at `token` of `cache_start`, `rows` ahead, then a row per `parts_per_row` parts.
  void start(const int8_t* cache_start, int64_t token, int64_t rows, int64_t parts_per_row) {
    cache = cache_start;
    block = token / block_size;
    row = token % block_size;
    credit = 0;
    cost = parts_per_row;
    for (int64_t i = 0; i < rows; ++i) next_row();
  }
  inline void ahead(int64_t parts) {
    for (credit += parts; credit >= cost; credit -= cost) next_row();
  }
  // Prefetch (into L2) the next row's lines, stopping at the context's end.
  inline void next_row() {
    if (block * block_size + row >= len) return;
    const int8_t* at = cache + (blocks[block] * block_size + row) * token_stride + offset;
    const uintptr_t mask = ~uintptr_t{kCacheLineBytes - 1};
    const uintptr_t last = reinterpret_cast<uintptr_t>(at + row_bytes - 1) & mask;
    for (uintptr_t line = reinterpret_cast<uintptr_t>(at) & mask; line <= last;
         line += kCacheLineBytes)
      __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 1);
    if (++row == block_size) {
      row = 0;
      ++block;
    }
  }
};

// How far the prefetch runs ahead: 256 lines (16 KiB; the shortest distance that reached full
// bandwidth for small rows, docs/experiments.md), or two groups of kLanes rows where that is
// more. Why the groups: each pass takes a group's rows kv head by kv head, so it wants the
// group's last rows as soon as its first; with large rows (8 kv heads of 128: a group is 64 KiB)
// 256 lines fell inside the group, and the kernel waited on rows it had not asked for yet.
constexpr int64_t kPrefetchLines = 256;

// The V pass's slice of a head, in vectors: the largest divisor of C whose G accumulators and one
// V slice fit the registers (with two to spare). Where the whole head does not fit (AVX2), the
// pass walks a group's rows once per slice: each slice is other cache lines of the same rows.
constexpr int64_t v_slice(int64_t C, int64_t G) {
  for (int64_t s = C; s > 1; --s) {
    if (C % s == 0 && (G + 1) * s <= kRegisters - 2) return s;
  }
  return 1;
}

// The part of a context a vector task reads: positions [lo, hi), and where its result goes.
// A context longer than a span is read span by span, the spans at fixed positions (multiples of
// span_tokens), each a task of its own, and their results merged (merge_spans): so one long
// context is shared out over the cores, with every kv head of a row in one task (a task per kv
// head fetches about twice an int8 row's bytes, its rows sharing cache lines with the next
// head's). Fixed positions keep a query's arithmetic a function of its own context, whatever
// the step holds. `partial` null: the task's queries are whole, written to the output;
// otherwise each (query, query head) leaves its softmax's max and sum and its unnormalised sum
// of V there (partial_floats(D) floats).
struct Span {
  int64_t lo, hi;
  float* partial;
};

constexpr int64_t partial_floats(int64_t dim) { return dim + 2; }

// Queries [i0, i1) of `run`, their query heads of kv heads [h0, h1); D is a multiple of kLanes,
// G query heads per kv head. Rows are taken kLanes at a time, every kv head of a row together,
// so each block's rows are read as one contiguous stretch, and every query of the run is served
// from a group of rows while it is in the L1 cache. Each query's arithmetic is what it would be
// alone (a query with fewer tokens skips the groups past its context and masks the rest of its
// last one), so its result is the same bits as its own decode's. (A window that cuts a
// context comes one query at a time: each query's window starts elsewhere.)
//
// A decode is bound by memory latency: each core keeps only so many cache line misses in
// flight (its line-fill buffers), and a software prefetch waits for a free one before it
// retires. So the prefetches are spread through the arithmetic, a few lines before each query
// head's scores and each V row, `distance` ahead: issued in a burst (the same row of the next
// block, for every row gathered), they filled the buffers, stalled retirement and left the
// arithmetic and the memory taking turns. The spacing matters: the same lines issued a row at a
// time, back to back, lost the whole gain. Into L2 (prefetcht2), which was faster than into L1;
// non-temporal prefetches were slower.
//
// kOne: a single query (a decode), compiled apart: its K pass keeps no mask of rows past a
// query's context in a register, which had cost a decode a tenth of its speed (K/V in cache).
//
// An int8 cache (T = int8_t) is read in place, its codes made floats in registers: the K pass
// converts a group's rows of a kv head once, each vector of codes times its block's scale, into
// a tile in L1 that its G query heads and every query of the run read as the float kernel reads
// the cache; the V pass scales each vector of codes it loads by its block's scale. (A vector of
// kLanes values lies in one block of kInt8Block.) The prefetch runs as far ahead in bytes, about
// four times as many rows.
template <typename T, int64_t D, int64_t G, bool kOne>
void attend_vec(const DecodeProblem& p, const QueryRun& run, int64_t h0, int64_t h1, int64_t i0,
                int64_t i1, const Span& span, std::vector<float>& scores,
                std::vector<VecL>& acc) {
  constexpr bool kCodes = std::is_same_v<T, int8_t>;
  constexpr int64_t W = kLanes, C = D / W, S = v_slice(C, G), R = head_row<T>(D);
  static_assert(kInt8Block % W == 0, "a vector of codes lies in one block of scales");
  const int64_t token_stride = p.kv_heads * R;
  const int64_t len = std::min(run.len_of(i1 - 1), span.hi);
  const int64_t first = std::max(p.first_of(run.len_of(i0)), span.lo), n = len - first;
  const int64_t nq = kOne ? 1 : i1 - i0, heads = h1 - h0, nh = heads * G, all = nq * nh;
  const int64_t stride = (n + W - 1) / W * W;  // each query head's scores, whole groups of W
  scores.resize(all * stride);
  acc.assign(all * C, VecL{});
  // Query x's head j is item x * nh + j. Its softmax max and sum, W lanes each (reduced after
  // their pass), and the tokens it sees from the walk's start.
  std::vector<VecL> lane_max(all, VecL{} - std::numeric_limits<float>::infinity());
  std::vector<VecL> lane_sum(all, VecL{});
  std::vector<int64_t> seen(kOne ? 0 : nq);  // a single query sees every row
  for (int64_t x = 0; x < static_cast<int64_t>(seen.size()); ++x)
    seen[x] = run.len_of(i0 + x) - first;  // past the span's end: every row it holds
  LanesL lane_index;  // 0, 1, ..., W - 1
  for (int64_t l = 0; l < W; ++l) lane_index[l] = l;
  auto query_heads = [&](int64_t x) {  // query x's nh query heads, D apart
    return p.q + (run.row + i0 + x) * p.q_stride + h0 * G * D;
  };
  // What a call asks for, so that a group's calls cover its W rows: one call per query head in
  // the K pass, one per kv head, slice and row in the V pass (the run's last query's, which sees
  // every row). Float rows fill whole lines, counted as lines; int8 rows as parts of a row.
  using Prefetcher = std::conditional_t<kCodes, RowPrefetcher, LinePrefetcher>;
  const int64_t lines_per_row = heads * D / kLineFloats;
  const int64_t v_calls = heads * (C / S);  // per row
  Prefetcher prefetch;
  int64_t distance, k_step, v_step;
  if constexpr (kCodes) {
    const int64_t row_bytes = heads * R;  // a token's row of kv heads [h0, h1)
    prefetch = {nullptr, run.blocks, p.block_size, token_stride, h0 * R, row_bytes, len};
    distance = std::max(kPrefetchLines * kCacheLineBytes / row_bytes, 2 * W);  // in rows
    k_step = W;  // parts, a row being nh of them in the K pass, v_calls in the V pass
    v_step = 1;
  } else {
    prefetch = {nullptr, run.blocks, p.block_size, token_stride, h0 * D, len, lines_per_row};
    distance = std::max(kPrefetchLines, 2 * W * lines_per_row);
    k_step = (W * lines_per_row + nh - 1) / nh;
    v_step = (lines_per_row + v_calls - 1) / v_calls;
  }
  auto start_prefetch = [&](const void* cache, int64_t calls_per_row) {
    if constexpr (kCodes)
      prefetch.start(static_cast<const int8_t*>(cache), first, distance, calls_per_row);
    else
      prefetch.start(static_cast<const float*>(cache), first, distance);
  };
  // Calls body(rows, count, index) with up to W row pointers (kv head h0 of each token);
  // a short group repeats its first row, and only `count` rows are real.
  auto for_each_group = [&](const void* cache, auto&& body) {
    const T* rows[W];
    int64_t count = 0, index = 0;
    for (int64_t b = first / p.block_size; b * p.block_size < len; ++b) {
      const int64_t t0 = b * p.block_size;
      const int64_t lo = std::max(first, t0) - t0, hi = std::min(len - t0, p.block_size);
      const T* base =
          static_cast<const T*>(cache) + (run.blocks[b] * p.block_size) * token_stride + h0 * R;
      for (int64_t o = lo; o < hi; ++o) {
        rows[count++] = base + o * token_stride;
        if (count == W) {
          body(rows, count, index);
          index += count;
          count = 0;
        }
      }
    }
    if (count > 0) {
      for (int64_t t = count; t < W; ++t) rows[t] = rows[0];
      body(rows, count, index);
    }
  };
  alignas(kCacheLineBytes) float key_tile[kCodes ? W * D : 1];  // int8: a group's K as floats
  start_prefetch(p.k, nh);
  for_each_group(p.k, [&](const T* const* rows, int64_t count, int64_t index) {
    for (int64_t h = 0; h < heads; ++h) {
      if constexpr (kCodes) {
        for (int64_t t = 0; t < W; ++t) {
          const int8_t* k = rows[t] + h * R;
          for (int64_t c = 0; c < C; ++c) {
            const float scale = block_scale(k, D, c * W / kInt8Block);
            store_lanes(key_tile + t * D + c * W, load_codes(k + c * W) * scale);
          }
        }
      }
      for (int64_t j = 0; j < G; ++j) {
        prefetch.ahead(k_step);
        for (int64_t x = 0; x < nq; ++x) {
          const int64_t real = kOne ? count : seen[x] - index;  // rows of the group x sees
          if (!kOne && real <= 0) continue;
          const float* qj = query_heads(x) + (h * G + j) * D;
          VecL q[C];
          for (int64_t c = 0; c < C; ++c) q[c] = load_lanes(qj + c * W);
          VecL part[W];
          for (int64_t t = 0; t < W; ++t) {
            const float* k;
            if constexpr (kCodes) k = key_tile + t * D;
            else k = rows[t] + h * D;
            VecL a = q[0] * load_lanes(k);
            for (int64_t c = 1; c < C; ++c) a += q[c] * load_lanes(k + c * W);
            part[t] = a;
          }
          const VecL s = sum_lanes(part) * p.scale;
          const int64_t item = x * nh + h * G + j;
          store_lanes(scores.data() + item * stride + index, s);
          // A short group's extra lanes repeat a real row; rows past the query's context are
          // left out.
          VecL& m = lane_max[item];
          if (kOne || real >= count) {
            m = s > m ? s : m;
          } else {
            const VecL seen_s = lane_index < static_cast<int32_t>(real) ? s : VecL{} - INFINITY;
            m = seen_s > m ? seen_s : m;
          }
        }
      }
    }
  });
  std::vector<float> head_max(all);
  for (int64_t item = 0; item < all; ++item) {
    head_max[item] = lane_max[item][0];
    for (int l = 1; l < W; ++l) head_max[item] = std::max(head_max[item], lane_max[item][l]);
  }
  start_prefetch(p.v, v_calls);
  for_each_group(p.v, [&](const T* const* rows, int64_t count, int64_t index) {
    // The softmax's numerators of these W tokens, made here rather than in a pass of their own
    // so that the arithmetic overlaps the V rows' arrival.
    for (int64_t x = 0; x < nq; ++x) {
      const int64_t real = kOne ? count : std::min(count, seen[x] - index);
      if (!kOne && real <= 0) continue;
      for (int64_t j = 0; j < nh; ++j) {
        const int64_t item = x * nh + j;
        float* w = scores.data() + item * stride + index;
        const VecL e = fast_exp(load_lanes(w) - head_max[item]);
        // Lanes past `real` hold no token of this query.
        const VecL numerators = lane_index < static_cast<int32_t>(real) ? e : VecL{};
        store_lanes(w, numerators);
        lane_sum[item] += numerators;
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t c0 = 0; c0 < C; c0 += S) {
        for (int64_t x = 0; x < nq; ++x) {
          const int64_t real = kOne ? count : std::min(count, seen[x] - index);
          if (!kOne && real <= 0) continue;
          const int64_t item = x * nh + h * G;  // the kv head's G query heads
          const float* w = scores.data() + item * stride + index;
          VecL a[G][S];
          for (int64_t j = 0; j < G; ++j)
            for (int64_t c = 0; c < S; ++c) a[j][c] = acc[(item + j) * C + c0 + c];
          for (int64_t t = 0; t < real; ++t) {  // each V slice is loaded once for the G queries
            if (x == nq - 1) prefetch.ahead(v_step);
            const T* row = rows[t] + h * R;
            VecL v[S];
            for (int64_t c = 0; c < S; ++c) {
              const int64_t at = (c0 + c) * W;
              if constexpr (kCodes)
                v[c] = load_codes(row + at) * block_scale(row, D, at / kInt8Block);
              else
                v[c] = load_lanes(row + at);
            }
            for (int64_t j = 0; j < G; ++j)
              for (int64_t c = 0; c < S; ++c) a[j][c] += w[j * stride + t] * v[c];
          }
          for (int64_t j = 0; j < G; ++j)
            for (int64_t c = 0; c < S; ++c) acc[(item + j) * C + c0 + c] = a[j][c];
        }
      }
    }
  });
  for (int64_t x = 0; x < nq; ++x) {
    for (int64_t j = 0; j < nh; ++j) {
      const int64_t item = x * nh + j;
      float total = 0.f;
      for (int l = 0; l < W; ++l) total += lane_sum[item][l];
      if (span.partial != nullptr) {
        float* part = span.partial + item * partial_floats(D);
        part[0] = head_max[item];
        part[1] = total;
        for (int64_t c = 0; c < C; ++c) store_lanes(part + 2 + c * W, acc[item * C + c]);
        continue;
      }
      const VecL inv = VecL{} + 1.f / total;
      float* out = p.out + ((run.row + i0 + x) * p.heads + h0 * G + j) * D;
      for (int64_t c = 0; c < C; ++c) store_lanes(out + c * W, acc[item * C + c] * inv);
    }
  }
}

// libgomp keeps a team of threads for every thread that opened a parallel region, and once
// the teams' threads outnumber the cores its waiting threads stop spinning and sleep at once:
// every later region then starts with futex wake-ups. The engine's steps run on its device
// thread; a team the host thread kept (from loading the model, say) made that thread's
// multi-threaded decode steps about twice as slow. This frees the calling thread's team
// (OpenMP 5's soft pause: a later region builds a new one).
bool release_openmp_threads() { return omp_pause_resource_all(omp_pause_soft) == 0; }

// The longest chunk after a cached context that reads the context in place as decodes (each
// query the decode of its token; a request's rows read K/V once as a run); longer ones gather
// it for SDPA's GEMMs. With 16 lanes up to 128 queries reach their first token sooner in place;
// with 8, a query's arithmetic costs more than SDPA's and 17-32 queries ran level or slower.
int64_t decode_like_tokens() { return kLanes == 16 ? 128 : 16; }

// Tests switch the vector kernels off to check the generic loop on a machine that has both.
std::atomic<bool> portable_attention{false};

bool set_generic_decode_attention(bool generic) { return portable_attention.exchange(generic); }

template <typename T, int64_t D, int64_t G>
void attend_queries(const DecodeProblem& p, const QueryRun& run, int64_t h0, int64_t h1,
                    int64_t i0, int64_t i1, const Span& span, std::vector<float>& scores,
                    std::vector<VecL>& acc) {
  if (i1 - i0 == 1) attend_vec<T, D, G, true>(p, run, h0, h1, i0, i1, span, scores, acc);
  else attend_vec<T, D, G, false>(p, run, h0, h1, i0, i1, span, scores, acc);
}

// The vector kernel for this head size and group, or null where only the generic loop fits.
using AttendVec = void (*)(const DecodeProblem&, const QueryRun&, int64_t, int64_t, int64_t,
                           int64_t, const Span&, std::vector<float>&, std::vector<VecL>&);

// Positions a span of a long context holds (Span); tests set fewer to split short contexts.
std::atomic<int64_t> span_tokens{1024};

int64_t set_decode_span_tokens(int64_t tokens) {
  TORCH_CHECK(tokens > 0, "a span holds at least one position");
  return span_tokens.exchange(tokens);
}

// The results of one (run, kv heads, queries) task's spans, merged in order: each span's sum of
// V scaled by exp(its max - the largest), over the scaled sums of its softmax. A span that holds
// none of a query's positions adds nothing; the span with the largest max is taken with weight
// exactly 1.
void merge_spans(const DecodeProblem& p, const QueryRun& run, int64_t h0, int64_t heads,
                 int64_t i0, int64_t i1, const std::vector<float*>& parts, int64_t dim) {
  const int64_t nh = heads * p.group, stride = partial_floats(dim);
  std::vector<float> acc(dim);
  for (int64_t x = 0; x < i1 - i0; ++x) {
    for (int64_t j = 0; j < nh; ++j) {
      const int64_t at = (x * nh + j) * stride;
      float top = -std::numeric_limits<float>::infinity();
      for (const float* part : parts)
        if (part[at + 1] > 0.f) top = std::max(top, part[at]);
      float total = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (const float* part : parts) {
        const float* span = part + at;
        if (!(span[1] > 0.f)) continue;
        const float w = span[0] == top ? 1.f : fast_exp(span[0] - top);
        total += w * span[1];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) acc[d] += w * span[2 + d];
      }
      const float inv = 1.f / total;
      float* out = p.out + ((run.row + i0 + x) * p.heads + h0 * p.group + j) * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[d] = acc[d] * inv;
    }
  }
}
template <typename T, int64_t D>
AttendVec vector_kernel_for_group(int64_t group) {
  switch (group) {
    case 1: return &attend_queries<T, D, 1>;
    case 2: return &attend_queries<T, D, 2>;
    case 3: return &attend_queries<T, D, 3>;
    case 4: return &attend_queries<T, D, 4>;
    case 8: return &attend_queries<T, D, 8>;
    default: return nullptr;
  }
}
template <typename T>
AttendVec vector_kernel(int64_t dim, int64_t group) {
  switch (dim) {
    case 32: return vector_kernel_for_group<T, 32>(group);
    case 64: return vector_kernel_for_group<T, 64>(group);
    case 128: return vector_kernel_for_group<T, 128>(group);
    default: return nullptr;
  }
}

// The decode rows as runs: row r joins the run before it when it is that run's next position
// (one token more) over the same blocks, which is how a verification lays out its k + 1 rows.
// Joining never changes a result: a query's result depends only on its row, its length and the
// blocks that length covers, which the run's block table row holds.
std::vector<QueryRun> decode_runs(const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  int64_t rows, int64_t block_size, int64_t sliding_window) {
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t bt_stride = block_tables.stride(0);
  std::vector<QueryRun> runs;
  runs.reserve(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* blocks = tables + r * bt_stride;
    if (!runs.empty()) {
      QueryRun& last = runs.back();
      const int64_t covered = (last.len + block_size - 1) / block_size;
      // A window that cuts a context starts each query's elsewhere: such rows stay alone.
      const bool windowless = sliding_window <= 0 || lens[r] <= sliding_window;
      if (windowless && lens[r] == last.len + 1 &&
          std::equal(blocks, blocks + covered, last.blocks)) {
        last.queries += 1;
        last.len = lens[r];
        last.blocks = blocks;
        continue;
      }
    }
    runs.push_back({r, 1, blocks, lens[r]});
  }
  return runs;
}

// Attention of every query of `runs` (a window cuts no context of a run of several queries:
// decode_runs). Tasks are runs, or (run, kv head) when runs are too few to share out by
// themselves, and a run whose tasks would still leave a core idle splits its queries into parts
// (each part reads the run's K/V once). The vector kernels read a context longer than a span
// span by span (Span), each span a task, counted as a run would be. T: the cache's element,
// float or int8_t.
template <typename T>
void attend_runs(const DecodeProblem& p, int64_t dim, const std::vector<QueryRun>& runs) {
  // Every core reads, whatever torch's thread count (tuned for the GEMMs): attention is bound by
  // memory bandwidth, which a second core nearly doubles. Where torch computes on one thread,
  // helpers come from its inter-op pool, whose threads sleep when idle (an OpenMP team would
  // spin on the core the host needs); where its OpenMP team computes, the team does (below).
  // Tasks are claimed one by one, so a core the host takes for a moment only shifts work to
  // the others. Short contexts stay on this thread: waking others would cost more than it saves.
  // Sleeping helpers pay from 2^18 floats of K (1 MiB; as fast as the best bound tried at short
  // and long contexts alike); the team, awake between the step's GEMMs, from 2^14 (64 KiB): at
  // one request a whole context of a few hundred tokens had been read by one core.
  const int64_t kv_heads = p.kv_heads;
  int64_t total_rows = 0;  // K rows the queries read, each query its own
  for (const QueryRun& run : runs) {
    for (int64_t i = 0; i < run.queries; ++i) {
      const int64_t len = run.len_of(i);
      total_rows += len - p.first_of(len);
    }
  }
  const int64_t procs = omp_get_num_procs();
  const bool team = omp_get_max_threads() >= procs;
  const int64_t least = team ? int64_t{1} << 14 : int64_t{1} << 18;
  const int64_t threads = total_rows * kv_heads * dim < least ? 1 : procs;
  const int64_t reqs = static_cast<int64_t>(runs.size());
  const AttendVec fast = portable_attention ? nullptr : vector_kernel<T>(dim, p.group);
  const int64_t span = fast != nullptr ? span_tokens.load() : std::numeric_limits<int64_t>::max();
  // A run's spans: from its first query's first position to its last query's context.
  auto spans_of = [&](const QueryRun& run, int64_t i0, int64_t i1) {
    const int64_t lo = p.first_of(run.len_of(i0)), hi = run.len_of(i1 - 1);
    return (hi - 1) / span - lo / span + 1;
  };
  int64_t units = 0;
  for (const QueryRun& run : runs) units += spans_of(run, 0, run.queries);
  const int64_t heads_per_task = units >= 4 * threads ? kv_heads : 1;
  const int64_t tasks_per_run = kv_heads / heads_per_task;
  const int64_t parts_wanted = (2 * threads + units * tasks_per_run - 1) / (units * tasks_per_run);
  struct Task {
    int64_t run, h0, i0, i1;
    Span span;
    int64_t partial_at;  // a split task's place in `partials`, or -1
  };
  struct Merge {  // a (run, kv heads, queries) read in spans: its tasks [first, first + count)
    int64_t first, count;
  };
  std::vector<Task> tasks;
  std::vector<Merge> merges;
  int64_t partial_size = 0;  // floats of partial results, handed out to split tasks below
  const int64_t nh = heads_per_task * p.group;
  for (int64_t r = 0; r < reqs; ++r) {
    const QueryRun& run = runs[r];
    const int64_t queries = run.queries, parts = std::min(queries, parts_wanted);
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t i0 = queries * part / parts, i1 = queries * (part + 1) / parts;
      const int64_t lo = p.first_of(run.len_of(i0)), hi = run.len_of(i1 - 1);
      const int64_t count = spans_of(run, i0, i1);
      for (int64_t h = 0; h < tasks_per_run; ++h) {
        if (count == 1) {
          tasks.push_back({r, h * heads_per_task, i0, i1, {lo, hi, nullptr}, -1});
          continue;
        }
        merges.push_back({static_cast<int64_t>(tasks.size()), count});
        for (int64_t k = lo / span; k * span < hi; ++k) {
          const Span piece{std::max(lo, k * span), std::min(hi, (k + 1) * span), nullptr};
          tasks.push_back({r, h * heads_per_task, i0, i1, piece, partial_size});
          partial_size += (i1 - i0) * nh * partial_floats(dim);
        }
      }
    }
  }
  std::vector<float> partials(partial_size);
  for (Task& t : tasks)
    if (t.partial_at >= 0) t.span.partial = partials.data() + t.partial_at;
  const int64_t items = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  auto work = [&] {
    std::vector<float> scores, acc;
    std::vector<VecL> vec_acc;
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const Task& t = tasks[item];
      const QueryRun& run = runs[t.run];
      const int64_t h1 = t.h0 + heads_per_task;
      if (fast != nullptr) {
        fast(p, run, t.h0, h1, t.i0, t.i1, t.span, scores, vec_acc);
        continue;
      }
      for (int64_t i = t.i0; i < t.i1; ++i) {
        switch (dim) {
          case 64: attend<T, 64>(p, run, i, t.h0, h1, dim, scores, acc); break;
          case 128: attend<T, 128>(p, run, i, t.h0, h1, dim, scores, acc); break;
          case 32: attend<T, 32>(p, run, i, t.h0, h1, dim, scores, acc); break;
          default: attend<T, 0>(p, run, i, t.h0, h1, dim, scores, acc);
        }
      }
    }
  };
  if (threads > 1 && team) {
    // torch's OpenMP team already runs this step's GEMMs, and after each parallel region its
    // workers spin (libgomp: ~300k pause loops, milliseconds) before they sleep. A helper from
    // the inter-op pool would share a core with a spinning worker; the team itself is awake.
    // (A microbenchmark that runs an OpenMP op between calls sees the same contention.)
#pragma omp parallel num_threads(threads)
    work();
  } else {
    std::latch helpers_done(threads - 1);
    for (int64_t t = 1; t < threads; ++t) {
      at::launch([&] {
        work();
        helpers_done.count_down();
      });
    }
    work();
    helpers_done.wait();
  }
  std::vector<float*> parts;
  for (const Merge& m : merges) {
    const Task& t = tasks[m.first];
    parts.clear();
    for (int64_t k = m.first; k < m.first + m.count; ++k) parts.push_back(tasks[k].span.partial);
    merge_spans(p, runs[t.run], t.h0, heads_per_task, t.i0, t.i1, parts, dim);
  }
}

// One query per row of q: row r against the context_lens[r] first tokens of block table row r
// (rows that continue a request's run are read together: decode_runs).
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale,
                            int64_t sliding_window) {
  check_float_rows(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(1) == q.size(2), "q must be [R, H, D], heads packed");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1), "out must be shaped like q");
  check_cache(k_cache, "k_cache", q.size(2));
  check_cache(v_cache, "v_cache", q.size(2));
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must be alike");
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.stride(1) == 1 && context_lens.is_contiguous(),
              "block table rows and context_lens must be contiguous");
  const int64_t reqs = q.size(0), dim = q.size(2), kv_heads = k_cache.size(2);
  DecodeProblem p{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
                  out.data_ptr<float>(), q.size(1), kv_heads, q.size(1) / kv_heads,
                  k_cache.size(1), q.stride(0), sliding_window, (float)scale};
  const auto runs = decode_runs(block_tables, context_lens, reqs, p.block_size, sliding_window);
  if (k_cache.scalar_type() == at::kChar) attend_runs<int8_t>(p, dim, runs);
  else attend_runs<float>(p, dim, runs);
}

// ---------------------------------------------------------------------------------------------
// The whole Llama-family forward in one call. Why: run op by op from Python, every op returns to
// the interpreter and needs the GIL, and a CPU "device" thread that needs the GIL a hundred times
// a step stalls behind the host thread whenever the host is scheduling the next step. One call
// per step releases the GIL once, so the host's work truly overlaps. The arithmetic is the
// Python model's with the fused ops above (tandem/models/llama.py and gemma3.py are the
// reference).

// Per layer, in this order; a missing optional weight is an empty tensor. Each linear layer is
// five tensors (`Linear.flat()` in ops/linear.py): its float32 weight, or its quantized values,
// then its panels (the float32 GEMM's packed weight), the quantized scales and offsets, and the
// bias. A mixture-of-experts layer has a router; its gate/up and down slots then hold every
// expert's projection (`Experts.flat()` in models/moe.py): an empty [out, 0] tensor (the out
// features), the stacked panels or quantized values, the scales and offsets, nothing. Qwen2-MoE's
// shared expert adds its two linear layers and its gate. Gemma 3 norms the attention's output
// and the MLP's before each joins the residual stream (kPostNorm is then its pre-MLP norm).
enum LayerWeight {
  kInputNorm, kQNorm, kKNorm, kPostNorm, kQkv, kO = kQkv + 5, kGateUp = kO + 5,
  kDown = kGateUp + 5, kRouter = kDown + 5, kSharedGateUp, kSharedDown = kSharedGateUp + 5,
  kSharedGate = kSharedDown + 5, kAttnOutNorm, kMlpOutNorm, kWeightsPerLayer
};

// ---- Float32 GEMM over weights packed in panels ----
// The weight [out, in] is packed once (ops/linear.py's pack_panels) as panels of kPanel output
// rows: panels[p, k, j] = weight[p * kPanel + j, k], zero past the last row. A tile of up to
// kPanelRows rows of x times one panel is a sum of outer products: per input k, the panel's
// kPanel weights (3 vectors, read in order) times x[m, k] broadcast, into kPanelRows x 3 vectors
// of sums. Why: each output is one lane's sum over k in order, then + bias, so
//   - there is no reduction across lanes, which held dot-product tiles to half the FMA rate;
//   - a row's result is the same bits whatever the step's row count, the tile, the thread split
//     or the vector width (the AVX2 and AVX-512 builds agree);
//   - a panel is one sequential stream, what the memory serves fastest at one row of x.
constexpr int64_t kPanelVectors = 3;
constexpr int64_t kPanel = kPanelVectors * kLanes;  // 48 outputs on AVX-512, 24 on AVX2
// Rows of x per tile: their sums, the panel's 3 vectors and a broadcast fill the registers (28
// of AVX-512's 32, 16 of AVX2's 16).
constexpr int64_t kPanelRows = kRegisters >= 32 ? 8 : 4;
constexpr int64_t kGemvMaxRows = 8;  // steps up to here walk the panels once, for all their rows

// Inputs a panel is multiplied over in one pass: its slice (48 x 1024 floats on AVX-512) stays
// in L2 while the task's rows pass; a longer `in` (a large model's down projection) takes
// several passes.
constexpr int64_t kInputsPerPass = 1024;

// How far ahead of its reads a streaming walk of a panel asks for its weights (2 KiB; the lines per
// input below), in tiles of up to kPrefetchRows rows. Why: a step of few rows reads every weight
// once, from memory, and the hardware's prefetcher alone left it further from the streaming rate.
// Larger steps reuse each panel slice from L2, and tiles of 8 rows (their sums and weights in 28 of
// AVX-512's registers) ran slower with it. Past a panel's end it reads ahead into the next one (a
// prefetch never faults).
constexpr int64_t kPrefetchFloats = 512;
constexpr int64_t kPrefetchRows = 4;
// Lines asked for per input: on AVX-512 an input's 48 weights are 3 whole lines, and each is
// asked for (one per input, leaving two to the hardware's prefetcher, was 1.2-1.3x slower at
// one row); on AVX2 its 24 weights are 1.5 lines, and asking for each gained nothing there.
constexpr int64_t kPanelBytes = kPanel * static_cast<int64_t>(sizeof(float));
constexpr int64_t kPrefetchesPerInput =
    kPanelBytes % kCacheLineBytes == 0 ? kPanelBytes / kCacheLineBytes : 1;

// Rows [0, MR) of x times one panel over inputs [k0, k1), into `width` outputs: sums start at
// zero for k0 = 0, else from the partial sums an earlier pass left in out (float32 either way,
// so the roundings are those of one pass); the bias is added after the last pass. `kStream`:
// the panel comes from memory, read once (prefetched ahead).
template <int64_t MR, bool kStream>
void panel_tile(const float* x, int64_t x_stride, const float* panel, int64_t k0, int64_t k1,
                const float* bias, float* out, int64_t out_stride, int64_t width) {
  alignas(64) float sums[kPanel] = {};
  VecL acc[MR][kPanelVectors] = {};
  if (k0 > 0) {
    for (int64_t m = 0; m < MR; ++m) {
      std::copy(out + m * out_stride, out + m * out_stride + width, sums);
      for (int64_t v = 0; v < kPanelVectors; ++v) acc[m][v] = load_lanes(sums + v * kLanes);
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    if constexpr (kStream && MR <= kPrefetchRows)
      for (int64_t line = 0; line < kPrefetchesPerInput; ++line)
        __builtin_prefetch(panel + k * kPanel + kPrefetchFloats + line * kLineFloats, 0, 3);
    VecL w[kPanelVectors];
    for (int64_t v = 0; v < kPanelVectors; ++v) w[v] = load_lanes(panel + k * kPanel + v * kLanes);
    for (int64_t m = 0; m < MR; ++m) {
      const float xs = x[m * x_stride + k];
      for (int64_t v = 0; v < kPanelVectors; ++v) acc[m][v] += w[v] * xs;
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t v = 0; v < kPanelVectors; ++v) store_lanes(sums + v * kLanes, acc[m][v]);
    float* row = out + m * out_stride;
    for (int64_t j = 0; j < width; ++j) row[j] = bias != nullptr ? sums[j] + bias[j] : sums[j];
  }
}

// Rows [0, rows) of x times one panel over inputs [k0, k1), kPanelRows at a time (bias: null
// but in the last pass; `kStream`: these are the step's every row, reading the panel once).
template <bool kStream>
void panel_rows(const float* x, int64_t x_stride, int64_t rows, const float* panel, int64_t k0,
                int64_t k1, const float* bias, float* out, int64_t out_stride, int64_t width) {
  for (int64_t m = 0; m < rows; m += kPanelRows) {
    const float* xm = x + m * x_stride;
    float* om = out + m * out_stride;
    auto tile = [&](auto r) {
      panel_tile<decltype(r)::value, kStream>(xm, x_stride, panel, k0, k1, bias, om, out_stride,
                                              width);
    };
    switch (std::min(kPanelRows, rows - m)) {
      case 1: tile(std::integral_constant<int64_t, 1>{}); break;
      case 2: tile(std::integral_constant<int64_t, 2>{}); break;
      case 3: tile(std::integral_constant<int64_t, 3>{}); break;
      case 4: tile(std::integral_constant<int64_t, 4>{}); break;
      case 5: if constexpr (kPanelRows > 5) tile(std::integral_constant<int64_t, 5>{}); break;
      case 6: if constexpr (kPanelRows > 6) tile(std::integral_constant<int64_t, 6>{}); break;
      case 7: if constexpr (kPanelRows > 7) tile(std::integral_constant<int64_t, 7>{}); break;
      default: if constexpr (kPanelRows > 4) tile(std::integral_constant<int64_t, kPanelRows>{});
    }
  }
}

// Rows of x one task multiplies in a large step: about 256 KiB of them (over one pass's
// inputs), which stay in L2 while the task's panels pass over them; a thread's next task keeps
// the same panels (in L2).
int64_t rows_per_task(int64_t in) {
  const int64_t inputs = std::clamp<int64_t>(in, 1, kInputsPerPass);
  const int64_t rows = (int64_t{1} << 16) / inputs / kPanelRows * kPanelRows;
  return std::max<int64_t>(rows, 2 * kPanelRows);
}

int64_t gemm_panel_width() { return kPanel; }

// Rows [row0, row0 + rows) of x times one weight's panels: a linear layer is one job, a layer's
// experts a job each over the rows routed to them.
struct PanelJob {
  int64_t row0, rows;
  const float* panels;
};

// Every job's rows times its panels ([num_panels, in, kPanel] each) into out [M, outs], all jobs
// as one task list. Tasks are (a job, a run of panels, a block of rows); jobs up to kGemvMaxRows
// rows take every row in one block, so each thread streams its panels once.
void gemm_jobs(const float* xp, int64_t x_stride, int64_t in, const std::vector<PanelJob>& jobs,
               int64_t num_panels, const float* bp, float* op, int64_t outs) {
  // 64 KiB of weights per task at least: smaller tasks cost more to hand out than they save.
  const int64_t run = std::max<int64_t>(1, ((1 << 14) + kPanel * in - 1) / (kPanel * in));
  const int64_t runs = (num_panels + run - 1) / run;
  std::vector<int64_t> row_block(jobs.size()), task_ends(jobs.size());
  int64_t tasks = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const int64_t rows = jobs[j].rows;
    row_block[j] = rows <= kGemvMaxRows ? rows : rows_per_task(in);
    task_ends[j] = tasks += runs * ((rows + row_block[j] - 1) / row_block[j]);
  }
  parallel_chunks(tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const size_t j = std::upper_bound(task_ends.begin(), task_ends.end(), t) - task_ends.begin();
      const PanelJob& job = jobs[j];
      const int64_t local = t - (j > 0 ? task_ends[j - 1] : 0);
      const int64_t row_blocks = (job.rows + row_block[j] - 1) / row_block[j];
      const int64_t m = job.row0 + local % row_blocks * row_block[j];
      const int64_t block = std::min(row_block[j], job.row0 + job.rows - m);
      const auto walk = job.rows <= kGemvMaxRows ? &panel_rows<true> : &panel_rows<false>;
      const int64_t first = local / row_blocks * run;
      for (int64_t p = first; p < std::min(num_panels, first + run); ++p) {
        const int64_t o = p * kPanel;
        for (int64_t k0 = 0; k0 < in; k0 += kInputsPerPass) {
          const int64_t k1 = std::min(in, k0 + kInputsPerPass);
          walk(xp + m * x_stride, x_stride, block, job.panels + p * in * kPanel, k0, k1,
               bp != nullptr && k1 == in ? bp + o : nullptr, op + m * outs + o, outs,
               std::min(kPanel, outs - o));
        }
      }
    }
  });
}

void check_panels(const at::Tensor& panels, int64_t in, int64_t outs) {
  const int64_t d = panels.dim();
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == at::kFloat && d >= 3 &&
                  panels.size(d - 2) == in && panels.size(d - 1) == kPanel &&
                  panels.size(d - 3) == (outs + kPanel - 1) / kPanel,
              "panels must be float32 [ceil(out / ", kPanel, "), in, ", kPanel,
              "] matching x (packed by ops/linear.py's pack_panels on this build)");
}

// x [M, in] @ weight.T (+ bias) over the weight's panels [ceil(outs / kPanel), in, kPanel]: out
// [M, outs].
at::Tensor gemm(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& bias, int64_t outs) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [rows, in]");
  TORCH_CHECK(panels.dim() == 3, "panels must be 3-D");
  check_panels(panels, x.size(1), outs);
  TORCH_CHECK(!present(bias) || (bias.is_contiguous() && bias.numel() == outs &&
                                 bias.scalar_type() == at::kFloat),
              "bias must be float32 [out]");
  const int64_t rows = x.size(0);
  auto out = at::empty({rows, outs}, x.options());
  if (rows == 0) return out;
  gemm_jobs(x.data_ptr<float>(), x.stride(0), x.size(1), {{0, rows, panels.data_ptr<float>()}},
            panels.size(0), present(bias) ? bias.data_ptr<float>() : nullptr,
            out.data_ptr<float>(), outs);
  return out;
}

// A layer's experts: rows [row_ends[e - 1], row_ends[e]) of x (sorted by expert) times expert e's
// panels (panels [experts, ceil(outs / kPanel), in, kPanel]), every expert in one task list.
at::Tensor gemm_experts(const at::Tensor& x, const at::Tensor& row_ends, const at::Tensor& panels,
                        int64_t outs) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [rows, in]");
  TORCH_CHECK(panels.dim() == 4, "panels must be 4-D [experts, panels, in, width]");
  check_panels(panels, x.size(1), outs);
  const int64_t experts = panels.size(0);
  const int64_t* ends = expert_row_ends(row_ends, experts, x.size(0));
  auto out = at::empty({x.size(0), outs}, x.options());
  const float* pp = panels.data_ptr<float>();
  const int64_t per_expert = panels.stride(0);
  std::vector<PanelJob> jobs;
  for (int64_t e = 0, row0 = 0; e < experts; row0 = ends[e++])
    if (ends[e] > row0) jobs.push_back({row0, ends[e] - row0, pp + e * per_expert});
  if (!jobs.empty())
    gemm_jobs(x.data_ptr<float>(), x.stride(0), x.size(1), jobs, panels.size(1), nullptr,
              out.data_ptr<float>(), outs);
  return out;
}

// The linear layer whose five tensors start at w[first]; `with_bias` false leaves the bias to the
// caller (a row-parallel layer adds it once, after the all-reduce).
at::Tensor linear(const at::Tensor& x, at::TensorList w, int64_t first, bool with_bias = true) {
  const at::Tensor &weight = w[first], &panels = w[first + 1], &bias = w[first + 4];
  const at::Tensor none;
  const at::Tensor& b = with_bias ? bias : none;
  if (weight.scalar_type() != at::kFloat) return quantized_linear(x, weight, w[first + 2], w[first + 3], b);
  if (present(panels))  // gemm honours a row stride (views of a fused projection need no copy)
    return gemm(x.stride(-1) == 1 ? x : x.contiguous(), panels, b, weight.size(0));
  return at::linear(x, weight, present(b) ? c10::optional<at::Tensor>(b) : c10::nullopt);
}

struct ForwardShape {
  int64_t heads, kv_heads, head_dim, block_size, num_decodes, sliding_window;
  double eps, scale;
};

// A layer's LoRA (tandem/ops/lora.py): per projection group, in this order, its a, b, ranks and
// part_ends (the `lora` argument's 16 tensors of the layer), and the step's slot of each token.
// No LoRA in this step: no tensors. A group whose a is empty (a mixture of experts' MLP) has none.
enum LoraGroup { kLoraQkv, kLoraO, kLoraGateUp, kLoraDown, kLoraGroups };
constexpr int64_t kLoraPerLayer = 4 * kLoraGroups;

struct LayerLora {
  at::TensorList w;  // kLoraPerLayer tensors, or none
  const at::Tensor* slots;

  // out (group g's GEMM result) += the deltas of x (its input), in place.
  void add(at::Tensor& out, const at::Tensor& x, LoraGroup g) const {
    if (w.empty() || !present(w[4 * g])) return;
    lora_add_(out, x, *slots, w[4 * g], w[4 * g + 1], w[4 * g + 2], w[4 * g + 3]);
  }
};

// Positions [0, len) of the cache from block blocks[0] on, as float rows [len, kv_heads,
// head_dim]: gathered, or an int8 cache's codes times their scales (kv_quant.dequantize's
// arithmetic, so the portable path reads the same values).
at::Tensor context_rows(const at::Tensor& cache, const at::Tensor& blocks, int64_t len,
                        const ForwardShape& s) {
  const int64_t nb = blocks.size(0), heads = s.kv_heads, D = s.head_dim;
  if (cache.scalar_type() == at::kFloat)
    return cache.index_select(0, blocks).view({nb * s.block_size, heads, D}).narrow(0, 0, len);
  auto out = at::empty({len, heads, D}, cache.options().dtype(at::kFloat));
  const at::Tensor held = blocks.contiguous();
  const int64_t* bp = held.data_ptr<int64_t>();
  const int8_t* cp = cache.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  const int64_t R = int8_row(D);
  at::parallel_for(0, len, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int8_t* src = cp + (bp[t / s.block_size] * s.block_size + t % s.block_size) * heads * R;
      for (int64_t h = 0; h < heads; ++h) dequantize_row(src + h * R, D, op + (t * heads + h) * D);
    }
  });
  return out;
}

// A chunk's own K or V rows [T, kv_heads, D] as attention reads them back from `cache`:
// themselves, or quantized and dequantized (kv_quant.cached_values), so that a chunk's result
// does not depend on whether its context was cached before it.
at::Tensor cached_rows(const at::Tensor& x, const at::Tensor& cache) {
  if (cache.scalar_type() == at::kFloat) return x;
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2), stride = x.stride(0);
  auto out = at::empty({tokens, heads, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
    std::vector<int8_t> row(int8_row(D));
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        quantize_row(xp + t * stride + h * D, D, row.data());
        dequantize_row(row.data(), D, op + (t * heads + h) * D);
      }
    }
  });
  return out;
}

// A chunk's attention after `past` cached keys ([1, heads, queries, D] of q; keys and values
// [1, kv_heads, past + queries, D]), as [queries, heads, D]: every query sees the cached keys,
// and the chunk's own keys causally. Two flash calls, the cached keys unmasked and the chunk's
// own square causal (its top-left alignment is then the right one), merged by their
// log-sum-exps. Why: one call needs the causal rule as an explicit [queries, keys] mask, which
// SDPA's flash kernel turns into a float mask as large as the scores and adds to every score,
// and it computes the masked scores too.
at::Tensor attend_after_context(const at::Tensor& qh, const at::Tensor& kh, const at::Tensor& vh,
                                int64_t past, double scale) {
  const int64_t heads = qh.size(1), queries = qh.size(2), D = qh.size(3);
  // The cached keys have no mask, so a KV head's query heads fold into one run of queries: each
  // K and V block is packed for the GEMMs once per group instead of once per head (same bits).
  const int64_t kv_heads = kh.size(1);
  auto [folded, folded_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      qh.reshape({1, kv_heads, heads / kv_heads * queries, D}), kh.narrow(2, 0, past),
      vh.narrow(2, 0, past), 0.0, false, {}, scale);
  const auto cached = folded.reshape({1, heads, queries, D});
  const auto cached_lse = folded_lse.reshape({1, heads, queries});
  auto [own, own_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      qh, kh.narrow(2, past, queries), vh.narrow(2, past, queries), 0.0, true, {}, scale);
  auto out = at::empty({queries, heads, D}, qh.options());
  const auto a = cached.accessor<float, 4>(), b = own.accessor<float, 4>();
  const auto la = cached_lse.accessor<float, 3>(), lb = own_lse.accessor<float, 3>();
  float* o = out.data_ptr<float>();
  // One pass (a parallel region, not one per elementwise op): each query head's two results
  // weighted by their shares of the softmax's sum. Every query sees at least one key in each
  // part, so both log-sum-exps are finite.
  at::parallel_for(0, queries * heads, grain_rows(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / heads, h = r % heads;
      const float top = std::max(la[0][h][i], lb[0][h][i]);
      const float wa = std::exp(la[0][h][i] - top), wb = std::exp(lb[0][h][i] - top);
      const float inv = 1.f / (wa + wb);
      const auto x = a[0][h][i], y = b[0][h][i];
      for (int64_t d = 0; d < D; ++d) o[r * D + d] = (x[d] * wa + y[d] * wb) * inv;
    }
  });
  return out;
}

// Causal attention of one prefill chunk (as ops/attention.py's _chunk_attention).
at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_row, int64_t num_tokens, int64_t context_len,
                           const ForwardShape& s) {
  // No cached prefix: the chunk's own K/V, as the cache holds them.
  const bool fresh = context_len == num_tokens;
  at::Tensor keys = fresh ? cached_rows(k, k_cache) : k;
  at::Tensor values = fresh ? cached_rows(v, v_cache) : v;
  int64_t first = 0;  // the first key position any query of the chunk sees
  if (context_len != num_tokens) {  // a cached prefix: gather the request's blocks
    if (s.sliding_window > 0) {  // from the window's first block: earlier ones may be freed
      const int64_t start = std::max<int64_t>(0, context_len - num_tokens - s.sliding_window + 1);
      first = start / s.block_size * s.block_size;
    }
    const int64_t b0 = first / s.block_size;
    const int64_t nb = (context_len + s.block_size - 1) / s.block_size - b0;
    auto blocks = block_row.narrow(0, b0, nb);
    keys = context_rows(k_cache, blocks, context_len - first, s);
    values = context_rows(v_cache, blocks, context_len - first, s);
  }
  auto qh = q.transpose(0, 1).unsqueeze(0);
  auto kh = keys.transpose(0, 1).unsqueeze(0);
  auto vh = values.transpose(0, 1).unsqueeze(0);
  if (context_len != num_tokens && s.sliding_window <= 0)
    return attend_after_context(qh, kh, vh, context_len - num_tokens, s.scale);
  at::Tensor out;
  if (context_len == num_tokens && s.sliding_window <= 0) {
    out = at::scaled_dot_product_attention(qh, kh, vh, {}, 0.0, true, s.scale, true);
  } else {
    auto opts = q.options().dtype(at::kLong);
    auto q_pos = at::arange(context_len - num_tokens, context_len, opts).unsqueeze(1);
    auto k_pos = at::arange(first, context_len, opts).unsqueeze(0);
    auto mask = k_pos <= q_pos;
    if (s.sliding_window > 0) mask = mask.logical_and(k_pos > q_pos - s.sliding_window);
    out = at::scaled_dot_product_attention(qh, kh, vh, mask, 0.0, false, s.scale, true);
  }
  return out.squeeze(0).transpose(0, 1);
}

at::Tensor attention_block(const at::Tensor& h, at::TensorList w, const at::Tensor& kv_cache,
                           const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& slot_mapping,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& prefills, const ForwardShape& s, double norm_eps,
                           const LayerLora& lora) {
  const int64_t q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim;
  auto qkv = linear(h, w, kQkv);
  lora.add(qkv, h, kLoraQkv);  // before the q/k norms and rotary
  auto q = qkv.narrow(1, 0, q_size).view({-1, s.heads, s.head_dim});
  auto k = qkv.narrow(1, q_size, kv_size).view({-1, s.kv_heads, s.head_dim});
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, s.kv_heads, s.head_dim});
  if (present(w[kQNorm])) {
    q = rms_norm(q, w[kQNorm], norm_eps);
    k = rms_norm(k, w[kKNorm], norm_eps);
  }
  rotary_(q, positions, cos, sin);
  rotary_(k, positions, cos, sin);
  auto k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  store_kv(k, v, k_cache, v_cache, slot_mapping);
  auto out = at::empty({h.size(0), s.heads, s.head_dim}, h.options());
  if (s.num_decodes > 0) {
    paged_decode_attention(out.narrow(0, 0, s.num_decodes), q.narrow(0, 0, s.num_decodes),
                           k_cache, v_cache, block_tables, context_lens, s.scale,
                           s.sliding_window);
  }
  // Rows: token_start, tokens, context, row, attends as decodes (PrefillSegment's fields).
  const int64_t* seg = prefills.data_ptr<int64_t>();
  for (int64_t i = 0; i < prefills.size(0); ++i, seg += 5) {
    if (seg[4]) {  // query j reads the context up to its own position, in place
      auto tables = block_tables.select(0, seg[3]).unsqueeze(0).expand({seg[1], -1});
      auto lens = at::arange(seg[2] - seg[1] + 1, seg[2] + 1, prefills.options());
      paged_decode_attention(out.narrow(0, seg[0], seg[1]), q.narrow(0, seg[0], seg[1]), k_cache,
                             v_cache, tables, lens, s.scale, s.sliding_window);
      continue;
    }
    out.narrow(0, seg[0], seg[1])
        .copy_(chunk_attention(q.narrow(0, seg[0], seg[1]), k.narrow(0, seg[0], seg[1]),
                               v.narrow(0, seg[0], seg[1]), k_cache, v_cache,
                               block_tables.select(0, seg[3]), seg[1], seg[2], s));
  }
  const auto attended = out.view({-1, q_size});
  auto o = linear(attended, w, kO, /*with_bias=*/false);  // bias: by the caller
  lora.add(o, attended, kLoraO);  // this rank's part of the sum, as the GEMM's
  return o;
}

// Tensor parallelism: sum `x` over the ranks of process group `group` (registered by name by
// torch.distributed), in place, through torch's functional collectives. No Python is involved,
// so a rank's step still needs the GIL once. An empty name means one rank: nothing to do.
void all_reduce_(at::Tensor& x, const std::string& group) {
  if (group.empty()) return;
  static auto reduce =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_reduce_", "");
  static auto wait =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  torch::jit::Stack stack{x, std::string("sum"), group};
  reduce.callBoxed(&stack);
  torch::jit::Stack waiting{x};
  wait.callBoxed(&waiting);
}

// Rows `ids` of an embedding held as a table [rows, hidden], or as the tied logits' panels
// [ceil(rows / width), hidden, width] (ops/linear.py's pack_panels), then its only copy.
at::Tensor embedding_rows(const at::Tensor& embed, const at::Tensor& ids) {
  if (embed.dim() == 2) return at::embedding(embed, ids);
  const int64_t width = embed.size(2);
  using at::indexing::Slice;
  return embed.index({at::floor_divide(ids, width), Slice(), at::remainder(ids, width)});
}

// The rows an embedding holds; panels count their padding rows, which pack_panels zeroes, so
// an id there looks up zeros, as a masked id does.
int64_t embedding_row_count(const at::Tensor& embed) {
  return embed.dim() == 2 ? embed.size(0) : embed.size(0) * embed.size(2);
}

// The embedding of a vocabulary shard (rows vocab_start ..): ids outside it give zeros, and
// the all-reduce fills each id's row from the one rank that holds it.
at::Tensor embed_tokens(const at::Tensor& embed, const at::Tensor& input_ids, int64_t vocab_start,
                        const std::string& group) {
  if (group.empty()) return embedding_rows(embed, input_ids);
  auto local = input_ids - vocab_start;
  auto outside = local.lt(0).logical_or(local.ge(embedding_row_count(embed)));
  auto x = embedding_rows(embed, local.masked_fill(outside, 0));
  x.masked_fill_(outside.unsqueeze(1), 0.0);
  all_reduce_(x, group);
  return x;
}

// One projection of every expert (the five tensors from w[first]) over rows sorted by expert.
at::Tensor experts_projection(const at::Tensor& rows, const at::Tensor& row_ends, at::TensorList w,
                              int64_t first) {
  const at::Tensor& stack = w[first + 1];
  if (stack.scalar_type() != at::kFloat)
    return quantized_experts(rows, row_ends, stack, w[first + 2], w[first + 3]);
  return gemm_experts(rows, row_ends, stack, w[first].size(0));
}

// A mixture-of-experts layer's MLP: ops/moe.py's `route` and `experts_in_one_pass`, the same ATen
// ops in the same order (so the same bits as the op-by-op forward), without a Python call each.
at::Tensor sparse_mlp(const at::Tensor& h, at::TensorList w, int64_t top_k, bool renormalize) {
  const at::Tensor& router = w[kRouter];
  const auto logits = at::linear(h, router);
  auto [weights, ids] = at::topk(at::softmax(logits, -1, at::kFloat), top_k, -1);
  if (renormalize) weights.div_(weights.sum(-1, /*keepdim=*/true));
  const auto flat = ids.flatten();
  const auto order = at::argsort(flat, /*stable=*/true);  // by expert, tokens ascending in each
  const auto tokens = at::div(order, top_k, "floor");
  const auto row_ends = at::bincount(flat, {}, router.size(0)).cumsum(0);
  // Each intermediate freed as the next is made (one expression would keep every temporary to
  // its end): a long prefill's rows are tokens x top-k.
  auto rows = h.index_select(0, tokens);
  auto gate_up = experts_projection(rows, row_ends, w, kGateUp);
  rows.reset();
  auto act = silu_and_mul(gate_up);
  gate_up.reset();
  auto ys = experts_projection(act, row_ends, w, kDown);
  act.reset();
  ys.mul_(weights.flatten().index({order}).unsqueeze(1));
  // Row by row in order, so each token's terms add by ascending expert.
  auto out = at::zeros_like(h).index_add_(0, tokens, ys);
  if (present(w[kSharedGate])) {  // the shared expert, every token, scaled by its gate
    const auto shared = linear(silu_and_mul(linear(h, w, kSharedGateUp)), w, kSharedDown);
    out.add_(at::sigmoid(at::linear(h, w[kSharedGate])) * shared);
  }
  return out;
}

// GeGLU (Gemma): tanh-approximated GELU of the gate times up, the ATen ops of the Python model's
// `gelu_tanh_and_mul` (ops/elementwise.py), so the same bits.
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  const int64_t inter = x.size(1) / 2;
  return at::gelu(x.narrow(1, 0, inter), "tanh").mul(x.narrow(1, inter, inter));
}

// Per layer (this stage's, in order): its rope table (cos, sin), its window (0: none) and its
// KV group's slots and block tables (a model whose layers attend alike: the same for every one).
at::Tensor llama_forward(const at::Tensor& input_ids, const at::Tensor& positions,
                         const at::Tensor& embed, at::TensorList weights,
                         at::TensorList kv_caches, const at::Tensor& final_norm,
                         at::TensorList cos, at::TensorList sin, at::TensorList slot_mappings,
                         at::TensorList block_tables, at::IntArrayRef windows,
                         const at::Tensor& context_lens, int64_t num_decodes,
                         const at::Tensor& prefills, int64_t block_size, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, double eps, double scale,
                         bool geglu, c10::string_view group_name, int64_t vocab_start,
                         int64_t moe_top_k, bool moe_renormalize, at::TensorList lora,
                         const at::Tensor& lora_slots, const std::optional<at::Tensor>& carried) {
  const auto layers = static_cast<size_t>(kv_caches.size());
  TORCH_CHECK(weights.size() == kWeightsPerLayer * layers, "expected ", kWeightsPerLayer,
              " weights per layer");
  TORCH_CHECK(cos.size() == layers && sin.size() == layers && slot_mappings.size() == layers &&
                  block_tables.size() == layers && windows.size() == layers,
              "expected a rope table, slots, block tables and a window per layer");
  const bool adapted = !lora.empty() && lora_slots.numel() > 0;
  TORCH_CHECK(!adapted || (int64_t)lora.size() == kLoraPerLayer * (int64_t)kv_caches.size(),
              "lora must be empty or ", kLoraPerLayer, " tensors per layer, got ", lora.size(),
              " for ", kv_caches.size(), " layers");
  TORCH_CHECK(prefills.dim() == 2 && prefills.size(1) == 5 && prefills.scalar_type() == at::kLong,
              "prefills must be int64 rows of 5 (PrefillSegment's fields, attends_as_decodes)");
  ForwardShape s{heads, kv_heads, head_dim, block_size, num_decodes, 0, eps, scale};
  const std::string group(group_name);
  // A pipeline stage after the first starts from the stream its predecessor stopped at:
  // carried = [2, T, hidden], the last layer's output and the residual before it. An embedding
  // kept in quantized blocks is looked up by the caller: carried = [1, T, hidden], no residual.
  const bool resumed = carried.has_value();
  at::Tensor x = resumed ? (*carried)[0] : embed_tokens(embed, input_ids, vocab_start, group);
  at::Tensor residual = resumed && carried->size(0) == 2 ? (*carried)[1] : at::Tensor(), h;
  for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
    auto w = weights.slice(layer * kWeightsPerLayer, kWeightsPerLayer);
    const LayerLora layer_lora{
        adapted ? lora.slice(layer * kLoraPerLayer, kLoraPerLayer) : at::TensorList(), &lora_slots};
    if (!residual.defined()) {
      residual = x;
      h = rms_norm(x, w[kInputNorm], eps);
    } else {
      h = add_rms_norm(x, residual, w[kInputNorm], eps);
    }
    s.sliding_window = windows[layer];
    auto a = attention_block(h, w, kv_caches[layer], positions, cos[layer], sin[layer],
                             slot_mappings[layer], block_tables[layer], context_lens, prefills, s,
                             eps, layer_lora);
    all_reduce_(a, group);  // O is row-parallel: its bias is added once, to the sum
    if (present(w[kO + 4])) a.add_(w[kO + 4]);
    if (present(w[kAttnOutNorm])) a = rms_norm(a, w[kAttnOutNorm], eps);
    h = add_rms_norm(a, residual, w[kPostNorm], eps);
    if (present(w[kRouter])) {
      x = sparse_mlp(h, w, moe_top_k, moe_renormalize);  // no LoRA on the experts
    } else {
      auto gate_up = linear(h, w, kGateUp);
      layer_lora.add(gate_up, h, kLoraGateUp);
      const auto act = geglu ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up);
      x = linear(act, w, kDown);
      layer_lora.add(x, act, kLoraDown);  // this rank's part of the sum, as the GEMM's
    }
    all_reduce_(x, group);  // down is row-parallel (each expert's too)
    if (present(w[kMlpOutNorm])) x = rms_norm(x, w[kMlpOutNorm], eps);
  }
  // A stage before the last hands its stream on as it is (no final norm).
  if (final_norm.numel() == 0) return at::stack({x, residual});
  return add_rms_norm(x, residual, final_norm, eps);
}

// The sampler's noise (tandem/sampling.py `uniform_noise`, the reference) in native 32-bit
// arithmetic: the same hash of (seed key, output index, vocab id), bit for bit. PyTorch has no
// wrapping 32-bit multiply, so the portable version emulates each one with several int64 ops
// over the whole [rows, vocab] tensor: about a hundred passes a step.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// The hash's parts: a row's key from its seed key and output index, a vocabulary id's column
// key, and the U(0, 1) value of one (row, column). `uniform_noise` and `sample_rows` both use
// them, so the sampler's draws and the noise matrix stay the same bits.
constexpr int64_t kMaxNoiseVocab = 0x61C88647;  // ids past it would wrap in the column key

inline uint32_t noise_row(int64_t seed_key, int64_t output_index) {
  return mix32(static_cast<uint32_t>(seed_key) ^ mix32(static_cast<uint32_t>(output_index)));
}

inline uint32_t noise_column(int64_t vocab_id) {
  return mix32(static_cast<uint32_t>(vocab_id + 0x9E3779B9LL));
}

inline float noise_uniform(uint32_t row, uint32_t column) {
  const uint32_t bits = mix32(mix32(row ^ column) ^ row);
  return (static_cast<float>(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

at::Tensor uniform_noise(const at::Tensor& seed_keys, const at::Tensor& output_index,
                         int64_t vocab) {
  TORCH_CHECK(seed_keys.scalar_type() == at::kLong && output_index.scalar_type() == at::kLong,
              "uniform_noise takes int64 seed keys and output indices");
  TORCH_CHECK(vocab < kMaxNoiseVocab, "vocab too large for the noise hash");
  auto keys = seed_keys.contiguous(), index = output_index.contiguous();
  const int64_t rows = keys.numel();
  auto out = at::empty({rows, vocab}, keys.options().dtype(at::kFloat));
  std::vector<uint32_t> col(vocab);
  for (int64_t v = 0; v < vocab; ++v) col[v] = noise_column(v);
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* o = index.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint32_t row = noise_row(k[r], o[r]);
      float* d = dst + r * vocab;
      for (int64_t v = 0; v < vocab; ++v) d[v] = noise_uniform(row, col[v]);
    }
  });
  return out;
}

// The first index of the largest of v[0 .. n), a NaN counting as the largest (torch.argmax's
// rule). Why: torch's CPU argmax compares one element at a time, and every greedy step takes
// one.
int64_t first_max(const float* v, int64_t cols) {
  // Each lane keeps its largest value and where it first saw it (a later equal value does
  // not replace it), so the row is read once; a NaN anywhere sends it to a plain scan.
  const float low = -std::numeric_limits<float>::infinity();
  Vec16 lanes = {low, low, low, low, low, low, low, low, low, low, low, low, low, low, low, low};
  Lanes16 where = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Lanes16 index = where, nan_lanes = {};
  int64_t i = 0;
  for (; i + 16 <= cols; i += 16, index += 16) {
    const Vec16 chunk = load16(v + i);
    const Lanes16 larger = chunk > lanes;
    lanes = larger ? chunk : lanes;
    where = larger ? index : where;
    nan_lanes |= chunk != chunk;
  }
  float best = low;
  int64_t at = cols;
  bool has_nan = false;
  for (int64_t l = 0; l < 16; ++l) {
    has_nan |= nan_lanes[l] != 0;
    if (i == 0) break;  // no whole group of 16: the tail below sees every value
    if (lanes[l] > best || (lanes[l] == best && where[l] < at)) best = lanes[l], at = where[l];
  }
  for (; i < cols; ++i) {
    has_nan |= v[i] != v[i];
    if (v[i] > best || at == cols) best = v[i], at = i;
  }
  if (has_nan) {
    at = 0;
    while (v[at] == v[at]) ++at;
  }
  return at;
}

// Row-wise argmax of a float32 matrix, as torch.argmax(dim=-1).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be a [rows, n > 0] matrix");
  const int64_t rows = x.size(0), cols = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = first_max(xp + r * stride, cols);
  });
  return out;
}

// log(x) for normal x > 0 in a form the compiler vectorises (libm's logf is a scalar call):
// x = m * 2^e with m in [sqrt(1/2), sqrt(2)), and Cephes' polynomial for log(m), within a few ulp.
__attribute__((always_inline)) inline float fast_log(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  float e = static_cast<float>((bits >> 23) - 126);
  bits = (bits & 0x007FFFFF) | 0x3F000000;  // the mantissa as a value in [0.5, 1)
  float m;
  std::memcpy(&m, &bits, sizeof(m));
  const bool low = m < 0.70710678f;
  e = low ? e - 1.f : e;
  const float f = low ? m + m - 1.f : m - 1.f;
  const float z = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  const float y = p * f * z - 2.12194440e-4f * e - 0.5f * z;
  return f + y + 0.693359375f * e;
}

// The sampler's plain path in one pass per row (tandem/sampling.py `sample`, the reference, for
// rows without top-k or top-p): temperature 0 is greedy; otherwise the token maximising
// softmax(logits / T)_i / E_i, where E_i = -log(U_i) is exponential noise from the same hash as
// `uniform_noise` (the exponential race: a draw from the softmax), and min_p drops tokens whose
// probability is below min_p times the largest. Why: the reference makes six passes over a
// [rows, vocab] matrix through torch; this reads the logits twice and makes no noise matrix.
// The arithmetic differs only in rounding (softmax's normaliser is left out: it scales every
// score alike), so a row picks another token than the reference only where two scores tie to
// float precision.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& min_p, const at::Tensor& seed_keys,
                       const at::Tensor& output_index) {
  check_float_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be a [rows, n > 0] matrix");
  TORCH_CHECK(logits.size(1) < kMaxNoiseVocab, "vocab too large for the noise hash");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto temp = temperature.to(at::kFloat).contiguous(), floor = min_p.to(at::kFloat).contiguous();
  auto keys = seed_keys.to(at::kLong).contiguous(), index = output_index.to(at::kLong).contiguous();
  TORCH_CHECK(temp.numel() == rows && floor.numel() == rows && keys.numel() == rows &&
                  index.numel() == rows,
              "one temperature, min_p, seed key and output index per row");
  auto greedy = argmax_rows(logits);
  const float* lp = logits.data_ptr<float>();
  const float* tp = temp.data_ptr<float>();
  const float* mp = floor.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  const int64_t* ip = index.data_ptr<int64_t>();
  int64_t* out = greedy.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(vocab), [&](int64_t begin, int64_t end) {
    std::vector<float> scores(vocab);
    for (int64_t r = begin; r < end; ++r) {
      const float* l = lp + r * stride;
      const float t = tp[r], cut = mp[r];
      const float top = l[out[r]] / t;  // the largest logit: division by t > 0 keeps the order
      if (!(t > 0.f) || !std::isfinite(top)) continue;  // greedy (or no finite largest logit)
      const uint32_t row = noise_row(kp[r], ip[r]);
      float* score = scores.data();
#pragma omp simd
      for (int64_t v = 0; v < vocab; ++v) {
        // Everything is computed and then selected: a branch would keep the loop scalar.
        const float x = l[v] / t - top, e = fast_exp(x);
        const float p = x < -87.f ? 0.f : e;  // probability times softmax's normaliser
        const float race = p / -fast_log(noise_uniform(row, noise_column(v)));
        score[v] = p < cut ? 0.f : race;
      }
      out[r] = first_max(score, vocab);
    }
  });
  return greedy;
}

// A grammar's token bitmask (xgrammar's layout: bit t % 32 of word t / 32 allows token t) applied
// in place: disallowed logits become -inf. Words that allow nothing, the common case, are
// written whole; words that allow everything are skipped.
void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask) {
  check_float_rows(logits, "logits");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "bitmask must be a contiguous [rows, words] int32 matrix");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  const int64_t words = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == rows && words * 32 >= vocab, "one bitmask row per logits row");
  float* lp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, grain_rows(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = lp + r * stride;
      const uint32_t* w = bp + r * words;
      for (int64_t k = 0; k * 32 < vocab; ++k) {
        const uint32_t bits = w[k];
        if (bits == 0xFFFFFFFFu) continue;
        float* x = row + k * 32;
        const int64_t n = std::min<int64_t>(32, vocab - k * 32);
        if (bits == 0) {
          std::fill_n(x, n, minus_inf);
          continue;
        }
        for (int64_t j = 0; j < n; ++j) x[j] = (bits >> j) & 1u ? x[j] : minus_inf;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def(
      "store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("uniform_noise(Tensor seed_keys, Tensor output_index, int vocab) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask) -> ()");
  m.def("gemm(Tensor x, Tensor panels, Tensor bias, int outs) -> Tensor");
  m.def("gemm_panel_width() -> int", &gemm_panel_width);
  m.def("gemm_experts(Tensor x, Tensor row_ends, Tensor panels, int outs) -> Tensor");
  m.def(
      "quantized_experts(Tensor x, Tensor row_ends, Tensor values, Tensor scales, "
      "Tensor offsets) -> Tensor");
  m.def(
      "quantized_linear(Tensor x, Tensor values, Tensor scales, Tensor offsets, Tensor bias) "
      "-> Tensor");
  m.def("quantized_rows(Tensor values, Tensor scales, Tensor offsets, Tensor ids) -> Tensor");
  m.def(
      "sample_rows(Tensor logits, Tensor temperature, Tensor min_p, Tensor seed_keys, "
      "Tensor output_index) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor context_lens, float scale, int sliding_window) -> ()");
  m.def("set_generic_decode_attention(bool generic) -> bool", &set_generic_decode_attention);
  m.def("set_decode_span_tokens(int tokens) -> int", &set_decode_span_tokens);
  m.def("release_openmp_threads() -> bool", &release_openmp_threads);
  m.def("decode_like_tokens() -> int", &decode_like_tokens);
  m.def("amx_tiles() -> bool", &tandem::amx_tiles);
  m.def("set_amx_tiles(bool use) -> bool", &tandem::set_amx_tiles);
  m.def(
      "llama_forward(Tensor input_ids, Tensor positions, Tensor embed, Tensor[] weights, "
      "Tensor[] kv_caches, Tensor final_norm, Tensor[] cos, Tensor[] sin, "
      "Tensor[] slot_mappings, Tensor[] block_tables, int[] windows, Tensor context_lens, "
      "int num_decodes, Tensor prefills, int block_size, int heads, int kv_heads, int head_dim, "
      "float eps, float scale, bool geglu, str group_name, int vocab_start, int moe_top_k, "
      "bool moe_renormalize, Tensor[] lora, Tensor lora_slots, Tensor? carried=None) -> Tensor");
  m.def(
      "lora_add_(Tensor(a!) out, Tensor x, Tensor slots, Tensor a, Tensor b, Tensor ranks, "
      "Tensor part_ends) -> ()");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("store_kv", &store_kv);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("uniform_noise", &uniform_noise);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("apply_token_bitmask_", &apply_token_bitmask_);
  m.impl("gemm", &gemm);
  m.impl("quantized_linear", &tandem::quantized_linear);
  m.impl("quantized_experts", &tandem::quantized_experts);
  m.impl("quantized_rows", &tandem::quantized_rows);
  m.impl("gemm_experts", &gemm_experts);
  m.impl("sample_rows", &sample_rows);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("llama_forward", &llama_forward);
  m.impl("lora_add_", &tandem::lora_add_);
}
