// What many unit tests share: the CPU backend's context they compute on, and step contexts.
#pragma once

#include <memory>

#include "backends/context.hpp"
#include "nn/step.hpp"

namespace dtrain::testing {

// The CPU backend's context (made once per test binary; the tests that use it run on one thread).
inline backends::Context& cpu() {
  static const std::unique_ptr<backends::Context> ctx = backends::make_context(Device{});
  return *ctx;
}
inline backends::Numerics& cpu_numerics() { return cpu().numerics(); }

// A training (or inference) step of one replica alone.
inline nn::StepContext step_of(nn::Mode mode, std::int64_t samples = 0) {
  nn::StepContext step;
  step.mode = mode;
  step.step_samples = samples;
  return step;
}

}  // namespace dtrain::testing
