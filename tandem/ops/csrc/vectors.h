// The vector width of the instruction set the kernels are built for, shared by the kernel files.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tandem {

// The width is the instruction set's register: a 16-lane kernel's 16 partial dot products and
// its queries fill AVX-512's 32 registers, and on AVX2 (16 registers of 8 lanes) the same code
// spilled every one of them and ran 3x slower than the generic loop; 8 lanes fit there.
#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
constexpr int64_t kRegisters = 32;
#else
constexpr int64_t kLanes = 8;
constexpr int64_t kRegisters = 16;
#endif
constexpr int64_t kCacheLineBytes = 64;  // what one prefetch brings in
using VecL = float __attribute__((vector_size(4 * kLanes)));
using LanesL = int32_t __attribute__((vector_size(4 * kLanes)));
using VecLUnaligned = float __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));
using LanesLUnaligned = int32_t __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));

inline VecL load_lanes(const float* p) { return *reinterpret_cast<const VecLUnaligned*>(p); }
inline void store_lanes(float* p, VecL v) { *reinterpret_cast<VecLUnaligned*>(p) = v; }

// An optional tensor argument: an empty tensor stands for none.
inline bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// x [M, K] @ W.T (+ bias) for W stored in quantized blocks (quantized_linear.cpp explains the
// layout); out [M, N] float32.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                            const at::Tensor& offsets, const at::Tensor& bias);
// Rows `ids` [T] of a weight in the layout quantized_linear takes, as float32 [T, K] (an
// embedding kept in its blocks; ops/quantized.py's dequantize_rows is the reference).
at::Tensor quantized_rows(const at::Tensor& values, const at::Tensor& scales,
                          const at::Tensor& offsets, const at::Tensor& ids);
// A layer's experts: rows [row_ends[e - 1], row_ends[e]) of x (sorted by expert) times expert
// e's weight, for every expert, in one task list; values, scales and offsets stacked [experts,
// ...] as quantized_linear takes one weight's.
at::Tensor quantized_experts(const at::Tensor& x, const at::Tensor& row_ends,
                             const at::Tensor& values, const at::Tensor& scales,
                             const at::Tensor& offsets);

// out [T, out] += each token's LoRA delta: x [T, in] through its slot's a [slots, parts, in, R]
// and b [slots, R, out], at the rank ranks[slot, part] of each part (columns up to part_ends);
// slot -1 adds nothing (lora.cpp; tandem/ops/lora.py's lora_add_reference_ is the reference).
void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
               const at::Tensor& b, const at::Tensor& ranks, const at::Tensor& part_ends);

// Whether quantized weights with float activations multiply on AMX tiles here (the build has
// them and the kernel granted the process their state).
bool amx_tiles();
// Lets the tiles be used (where `amx_tiles` can be true) or not; returns the previous setting.
bool set_amx_tiles(bool use);

}  // namespace tandem
