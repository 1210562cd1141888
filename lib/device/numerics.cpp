#include "device/numerics.hpp"

#include <vector>

namespace dtrain::device {

void Numerics::adam_update_all(const AdamStep& step, std::span<const AdamVariable> variables) {
  for (const AdamVariable& v : variables) adam_update(step, v.w, v.g, v.m, v.v, v.n);
}

void Numerics::label_hits(const float* pred, const std::int32_t* labels, std::int64_t rows, std::int64_t columns,
                          std::int32_t* hits, bool) {
  // A backend without a kernel of its own for it: the argmax and the labels on the host, now.
  std::vector<std::int32_t> host_labels(static_cast<std::size_t>(rows));
  argmax_rows(pred, rows, columns, hits);
  to_host(labels, host_labels.data(), host_labels.size() * sizeof(std::int32_t));
  for (std::size_t i = 0; i < host_labels.size(); ++i) {
    const std::int32_t label = host_labels[i];
    hits[i] = label < 0 || label >= columns ? -1 : hits[i] == label ? 1 : 0;
  }
}

}  // namespace dtrain::device
