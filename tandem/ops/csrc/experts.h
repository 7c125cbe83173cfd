// A mixture of experts' rows, sorted by expert: what the expert kernels of both sources take.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace tandem {

// `row_ends[e]`: the end of expert e's rows in x (int64 [experts] on the CPU), rising from 0 to
// x's `rows`; checked here, as both expert kernels index x by them.
inline const int64_t* expert_row_ends(const at::Tensor& row_ends, int64_t experts, int64_t rows) {
  TORCH_CHECK(row_ends.device().is_cpu() && row_ends.scalar_type() == at::kLong &&
                  row_ends.dim() == 1 && row_ends.size(0) == experts,
              "row_ends must be int64 [experts] on the CPU");
  const int64_t* ends = row_ends.data_ptr<int64_t>();
  TORCH_CHECK(std::is_sorted(ends, ends + experts) && (experts == 0 || ends[0] >= 0) &&
                  (experts == 0 ? rows == 0 : ends[experts - 1] == rows),
              "row_ends must rise from 0 to x's ", rows, " rows");
  return ends;
}

}  // namespace tandem
