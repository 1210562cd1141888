#include "distribute/staged_gradients.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::distribute {

StagedGradients::StagedGradients(device::Context& ctx, Tensor arena)
    : ctx_(&ctx), arena_(std::move(arena)), in_place_(arena_.host_accessible()) {
  DTRAIN_CHECK(arena_.dtype() == DType::f32, "a gradient arena holds f32");
  const auto n = static_cast<std::size_t>(arena_.numel());
  if (in_place_) {
    host_ = arena_.span<float>();
  } else {
    staging_.assign(n, 0.0f);
    host_ = staging_;
  }
}

void StagedGradients::to_host(std::size_t first, std::size_t count) {
  DTRAIN_CHECK(first + count <= host_.size(), fmt::format("staging floats [{}, {}) of {}", first, first + count, host_.size()));
  if (in_place_ || count == 0) return;
  ctx_->copy_to_host(arena_.address<float>() + first, host_.data() + first, count * sizeof(float));
}

void StagedGradients::from_host(std::size_t first, std::size_t count) {
  DTRAIN_CHECK(first + count <= host_.size(), fmt::format("staging floats [{}, {}) of {}", first, first + count, host_.size()));
  if (in_place_ || count == 0) return;
  ctx_->copy_from_host(host_.data() + first, arena_.address<float>() + first, count * sizeof(float));
}

}  // namespace dtrain::distribute
