// LoRA deltas of a step whose tokens use different adapters (tandem/ops/lora.py's
// lora_add_reference_ is the reference): out[t] += B_s (A_s x[t]) for the adapter slot s of each
// token, the base model's tokens (slot -1) left alone. Weights as the device holds them, per
// projection group: a [slots, parts, in, R], b [slots, R, out] (the scaling folded in), ranks
// [slots, parts] (0: the slot leaves that part alone), part_ends [parts] (the parts' column ends).
//
// The step's adapted rows are sorted by slot (a counting sort, rows ascending within a slot), so
// a slot's weights are read once per block of its rows, then two phases, each a list of tasks
// shared out to torch's threads (tasks.h): the shrink h[t, p, :rank] = x[t] @ a[s, p, :, :rank]
// (every part of a slot in one tile where their ranks fit: a decode's one row of a slot then has
// a chain of sums per part in flight, not one), and the expand out[t, j] += h[t, p(j), :rank] @
// b[s, :rank, j] (tasks of a part's columns). Both are the same tile: a few rows times a few
// vectors of weights, a sum of outer products over the inputs (k for the shrink, r for the
// expand) in ascending order, each output one lane's chain of FMAs. So a row's result is the same
// bits whatever else the step holds, the tile or task it falls in, the thread split and the
// vector width (the AVX2 and AVX-512 builds agree).

#include <ATen/ATen.h>

#include "tasks.h"
#include "vectors.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace tandem {
namespace {

// Lanes [0, n) of a vector, the others zero when loaded and left alone when stored: a vector of
// a rank or of a part's columns that ends inside it.
struct LaneMask {
#ifdef __AVX512F__
  __mmask16 bits;
  explicit LaneMask(int64_t n) : bits(static_cast<__mmask16>((1u << n) - 1)) {}
  VecL load(const float* p) const {
    return reinterpret_cast<VecL>(_mm512_maskz_loadu_ps(bits, p));
  }
  void store(float* p, VecL v) const {
    _mm512_mask_storeu_ps(p, bits, reinterpret_cast<__m512>(v));
  }
#else
  __m256i bits;
  explicit LaneMask(int64_t n)
      : bits(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))) {}
  VecL load(const float* p) const { return reinterpret_cast<VecL>(_mm256_maskload_ps(p, bits)); }
  void store(float* p, VecL v) const { _mm256_maskstore_ps(p, bits, reinterpret_cast<__m256>(v)); }
#endif
};

// w * s + acc in every lane, rounded once. Written out: GCC contracts `acc += w * s` into an FMA
// in some tile shapes and not in others (AVX2), so a row's bits depended on its step's rows.
inline VecL fma_lanes(VecL w, float s, VecL acc) {
#ifdef __AVX512F__
  return reinterpret_cast<VecL>(_mm512_fmadd_ps(reinterpret_cast<__m512>(w), _mm512_set1_ps(s),
                                                reinterpret_cast<__m512>(acc)));
#else
  return reinterpret_cast<VecL>(_mm256_fmadd_ps(reinterpret_cast<__m256>(w), _mm256_set1_ps(s),
                                                reinterpret_cast<__m256>(acc)));
#endif
}

// A tile's rows and vectors: their sums, the vectors of weights and a broadcast fill the
// registers (29 of AVX-512's 32; 11 of AVX2's 16).
constexpr int64_t kTileRows = kRegisters >= 32 ? 6 : 4;
constexpr int64_t kTileVectors = kRegisters >= 32 ? 4 : 2;
// A task's rows, and in the expand its columns of a part: a decode's rows of a slot are one
// block.
constexpr int64_t kBlockRows = 8 * kTileRows;
constexpr int64_t kChunkColumns = 256;
constexpr int64_t kChunkVectors = (kChunkColumns + kLanes - 1) / kLanes;
// Below this many multiply-adds a call runs on the calling thread: waking the others would cost
// more than it saves (a decode of a few rows of one adapter).
constexpr int64_t kParallelWork = int64_t{1} << 16;

// One vector of a tile's columns: input i's weights at w + i * w_stride, of which the first
// `lanes` count; its sums go to dst[m] + offset.
struct TileVector {
  const float* w;
  int64_t offset, lanes;
};

// MR rows times NV vectors, for the lanes c that count:
//   dst[m][offset + c] (+)= sum_{i < n} lhs[m][i] * w[i * w_stride + c]
// (+= where kAdd), the sum over i in ascending order from zero, one lane's FMA each, then added
// to dst. Vectors are read whole (a partial one's extra lanes are other weights, summed apart and
// never stored) for the first `whole` values of i, masked for the others: those near the
// tensor's end, where a whole vector would read past it. Why not masked throughout: with a
// masked load in the loop GCC kept the sums in memory, a store per FMA, which halved the tile's
// speed. Either way a lane's arithmetic is the same.
template <int64_t MR, int64_t NV, bool kAdd>
void lora_tile(const float* const* lhs, int64_t n, const TileVector* vec, int64_t w_stride,
               float* const* dst, int64_t whole) {
  const float* w[NV];
  for (int64_t v = 0; v < NV; ++v) w[v] = vec[v].w;
  VecL acc[MR][NV] = {};
  auto step = [&](int64_t i, const VecL (&wv)[NV]) __attribute__((always_inline)) {
    for (int64_t m = 0; m < MR; ++m) {
      const float s = lhs[m][i];
      for (int64_t v = 0; v < NV; ++v) acc[m][v] = fma_lanes(wv[v], s, acc[m][v]);
    }
  };
  int64_t i = 0;
  for (; i < whole; ++i) {
    VecL wv[NV];
    for (int64_t v = 0; v < NV; ++v) wv[v] = load_lanes(w[v] + i * w_stride);
    step(i, wv);
  }
  for (; i < n; ++i) {
    VecL wv[NV];
    for (int64_t v = 0; v < NV; ++v) wv[v] = LaneMask(vec[v].lanes).load(w[v] + i * w_stride);
    step(i, wv);
  }
  for (int64_t v = 0; v < NV; ++v) {
    const int64_t offset = vec[v].offset;
    if (vec[v].lanes == kLanes) {
      for (int64_t m = 0; m < MR; ++m) {
        float* d = dst[m] + offset;
        store_lanes(d, kAdd ? load_lanes(d) + acc[m][v] : acc[m][v]);
      }
    } else {
      const LaneMask mask(vec[v].lanes);
      for (int64_t m = 0; m < MR; ++m) {
        float* d = dst[m] + offset;
        mask.store(d, kAdd ? mask.load(d) + acc[m][v] : acc[m][v]);
      }
    }
  }
}

using TileFn = void (*)(const float* const*, int64_t, const TileVector*, int64_t, float* const*,
                        int64_t);

template <bool kAdd, int64_t... M, int64_t... V>
constexpr auto tile_table(std::integer_sequence<int64_t, M...>,
                          std::integer_sequence<int64_t, V...> vs) {
  auto row = [](auto mr, std::integer_sequence<int64_t, V...>) {
    return std::array<TileFn, kTileVectors>{&lora_tile<decltype(mr)::value, V + 1, kAdd>...};
  };
  return std::array<std::array<TileFn, kTileVectors>, kTileRows>{
      row(std::integral_constant<int64_t, M + 1>{}, vs)...};
}

// kTiles<kAdd>[rows - 1][vectors - 1]
template <bool kAdd>
const auto kTiles = tile_table<kAdd>(std::make_integer_sequence<int64_t, kTileRows>{},
                                     std::make_integer_sequence<int64_t, kTileVectors>{});

// `rows` rows (lhs[m], dst[m]) times `count` vectors of weights (their tensor ends at w_end),
// tile by tile: vectors outer, so each tile's weights stay in cache while the rows pass.
template <bool kAdd>
void lora_tiles(const float* const* lhs, int64_t rows, int64_t n, const TileVector* vecs,
                int64_t count, int64_t w_stride, const float* w_end, float* const* dst) {
  for (int64_t v0 = 0; v0 < count; v0 += kTileVectors) {
    const int64_t nv = std::min(kTileVectors, count - v0);
    int64_t whole = n;  // the inputs whose whole vectors all end within the tensor
    for (int64_t v = v0; v < v0 + nv; ++v) {
      const int64_t room = (w_end - vecs[v].w) - kLanes;
      whole = std::min(whole, room < 0 ? 0 : room / w_stride + 1);
    }
    for (int64_t m = 0; m < rows; m += kTileRows) {
      const int64_t mr = std::min(kTileRows, rows - m);
      kTiles<kAdd>[mr - 1][nv - 1](lhs + m, n, vecs + v0, w_stride, dst + m, whole);
    }
  }
}

// A task: rows [row0, row0 + rows) of the step's rows sorted by slot (all of one slot). In the
// shrink, vectors [first, first + count) of the slot's (its parts' ranks, back to back); in the
// expand, columns [first, first + count) of one part.
struct LoraTask {
  int64_t slot, part, row0, rows, first, count;
};

// Runs tasks [0, n) on torch's threads, or on this one where `work` (multiply-adds) is small.
template <typename F>
void run_tasks(int64_t n, int64_t work, const F& f) {
  if (work < kParallelWork) {
    for (int64_t t = 0; t < n; ++t) f(t);
    return;
  }
  parallel_chunks(n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) f(t);
  });
}

void check_cpu(const at::Tensor& t, at::ScalarType type, const char* name, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "lora_add_: ", name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == type, "lora_add_: ", name, " must be ", what, ", got ",
              t.scalar_type());
}

}  // namespace

void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
               const at::Tensor& b, const at::Tensor& ranks, const at::Tensor& part_ends) {
  check_cpu(out, at::kFloat, "out", "float32");
  check_cpu(x, at::kFloat, "x", "float32");
  check_cpu(slots, at::kLong, "slots", "int64");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1,
              "lora_add_: out must be [T, out] with a contiguous last dimension");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1,
              "lora_add_: x must be [T, in] with a contiguous last dimension");
  const int64_t T = x.size(0), in = x.size(1), outs = out.size(1);
  TORCH_CHECK(out.size(0) == T, "lora_add_: out has ", out.size(0), " rows, x has ", T);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T, "lora_add_: slots must be int64 [T] (T = ",
              T, "), got shape ", slots.sizes());
  if (a.numel() == 0 || T == 0) return;  // a group without LoRA (a mixture of experts' MLP)
  check_cpu(a, at::kFloat, "a", "float32");
  check_cpu(b, at::kFloat, "b", "float32");
  check_cpu(ranks, at::kLong, "ranks", "int64");
  check_cpu(part_ends, at::kLong, "part_ends", "int64");
  TORCH_CHECK(a.dim() == 4 && a.is_contiguous() && a.size(2) == in,
              "lora_add_: a must be contiguous float32 [slots, parts, in = ", in, ", rank], got ",
              a.sizes());
  const int64_t S = a.size(0), P = a.size(1), R = a.size(3);
  TORCH_CHECK(b.dim() == 3 && b.is_contiguous() && b.size(0) == S && b.size(1) == R &&
                  b.size(2) == outs,
              "lora_add_: b must be contiguous float32 [slots = ", S, ", rank = ", R,
              ", out = ", outs, "], got ", b.sizes());
  TORCH_CHECK(ranks.dim() == 2 && ranks.size(0) == S && ranks.size(1) == P,
              "lora_add_: ranks must be int64 [slots = ", S, ", parts = ", P, "], got ",
              ranks.sizes());
  TORCH_CHECK(part_ends.dim() == 1 && part_ends.size(0) == P,
              "lora_add_: part_ends must be int64 [parts = ", P, "], got ", part_ends.sizes());
  const at::Tensor slots_held = slots.contiguous(), ranks_held = ranks.contiguous(),
                   ends_held = part_ends.contiguous();
  const int64_t* slot = slots_held.data_ptr<int64_t>();
  const int64_t* rank = ranks_held.data_ptr<int64_t>();
  const int64_t* ends = ends_held.data_ptr<int64_t>();
  for (int64_t p = 0, start = 0; p < P; start = ends[p++])
    TORCH_CHECK(ends[p] >= start, "lora_add_: part_ends must rise from 0, got ", part_ends);
  TORCH_CHECK(ends[P - 1] == outs, "lora_add_: part_ends must end at out = ", outs, ", got ",
              part_ends);
  for (int64_t i = 0; i < S * P; ++i)
    TORCH_CHECK(rank[i] >= 0 && rank[i] <= R, "lora_add_: ranks[", i / P, ", ", i % P, "] = ",
                rank[i], " is outside [0, ", R, "] (the rank of a and b)");

  // The adapted rows grouped by slot, ascending within each (a counting sort); slots that adapt
  // no part are dropped.
  std::vector<int64_t> first(S + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < S, "lora_add_: slots[", t, "] = ", slot[t],
                " is outside [-1, ", S, ")");
    if (slot[t] >= 0) ++first[slot[t] + 1];
  }
  std::vector<bool> adapts(S, false);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t p = 0; p < P; ++p) adapts[s] = adapts[s] || rank[s * P + p] > 0;
    if (!adapts[s]) first[s + 1] = 0;
    first[s + 1] += first[s];
  }
  const int64_t n = first[S];
  if (n == 0) return;
  std::vector<int64_t> order(n);
  {
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t t = 0; t < T; ++t)
      if (slot[t] >= 0 && adapts[slot[t]]) order[next[slot[t]]++] = t;
  }

  // h [n, P, HR] in the sorted rows' order, each part's rank padded to whole vectors (the
  // shrink writes them whole; the expand reads each part's first `rank` values).
  const int64_t HR = (R + kLanes - 1) / kLanes * kLanes, h_row = P * HR;
  std::unique_ptr<float[]> h(new float[n * h_row]);
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float *a_end = ap + a.numel(), *b_end = bp + b.numel();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);

  // The shrink's vectors, slot by slot: every part's rank in one tile where they fit, so a
  // decode's few rows of a slot have a chain of sums per part and row in flight, not one.
  std::vector<TileVector> vecs;
  std::vector<LoraTask> shrink, expand;
  int64_t shrink_work = 0, expand_work = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (first[s + 1] == first[s]) continue;
    const int64_t v0 = static_cast<int64_t>(vecs.size());
    for (int64_t p = 0, start = 0; p < P; start = ends[p++]) {
      const int64_t r = rank[s * P + p];
      if (r == 0 || ends[p] == start) continue;
      for (int64_t r0 = 0; r0 < r; r0 += kLanes)
        vecs.push_back({ap + ((s * P + p) * in) * R + r0, p * HR + r0, std::min(kLanes, r - r0)});
      for (int64_t row0 = first[s]; row0 < first[s + 1]; row0 += kBlockRows) {
        const int64_t rows = std::min(kBlockRows, first[s + 1] - row0);
        for (int64_t c0 = start; c0 < ends[p]; c0 += kChunkColumns)
          expand.push_back({s, p, row0, rows, c0, std::min(kChunkColumns, ends[p] - c0)});
      }
      shrink_work += (first[s + 1] - first[s]) * in * r;
      expand_work += (first[s + 1] - first[s]) * (ends[p] - start) * r;
    }
    const int64_t v1 = static_cast<int64_t>(vecs.size());
    for (int64_t row0 = first[s]; row0 < first[s + 1]; row0 += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, first[s + 1] - row0);
      for (int64_t v = v0; v < v1; v += kTileVectors)
        shrink.push_back({s, -1, row0, rows, v, std::min(kTileVectors, v1 - v)});
    }
  }

  run_tasks(static_cast<int64_t>(shrink.size()), shrink_work, [&](int64_t i) {
    const LoraTask& task = shrink[i];
    const float* lhs[kBlockRows];
    float* dst[kBlockRows];
    for (int64_t m = 0; m < task.rows; ++m) {
      lhs[m] = xp + order[task.row0 + m] * x_stride;
      dst[m] = h.get() + (task.row0 + m) * h_row;
    }
    lora_tiles<false>(lhs, task.rows, in, vecs.data() + task.first, task.count, R, a_end, dst);
  });
  run_tasks(static_cast<int64_t>(expand.size()), expand_work, [&](int64_t i) {
    const LoraTask& task = expand[i];
    const float* lhs[kBlockRows];
    float* dst[kBlockRows];
    for (int64_t m = 0; m < task.rows; ++m) {
      lhs[m] = h.get() + (task.row0 + m) * h_row + task.part * HR;
      dst[m] = op + order[task.row0 + m] * out_stride;
    }
    TileVector columns[kChunkVectors];
    const int64_t count = (task.count + kLanes - 1) / kLanes;
    for (int64_t v = 0; v < count; ++v) {
      const int64_t c = task.first + v * kLanes;
      const int64_t lanes = std::min(kLanes, task.first + task.count - c);
      columns[v] = {bp + task.slot * R * outs + c, c, lanes};
    }
    lora_tiles<true>(lhs, task.rows, rank[task.slot * P + task.part], columns, count, outs, b_end,
                     dst);
  });
}

}  // namespace tandem
