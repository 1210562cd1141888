// What many unit tests share: the CPU backend's context they compute on, and step contexts.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/bfloat16.hpp"
#include "device/context.hpp"
#include "nn/conv2d.hpp"
#include "nn/layer.hpp"
#include "nn/step.hpp"

namespace dtrain::testing {

// The CPU backend's context (made once per test binary; the tests that use it run on one thread).
inline device::Context& cpu() {
  static const std::unique_ptr<device::Context> ctx = device::make_context(Device{});
  return *ctx;
}
inline device::Numerics& cpu_numerics() { return cpu().numerics(); }

// Whether the CPU computes in bfloat16 (mixed_bfloat16's tests skip with a message where not).
inline bool cpu_has_bf16() { return cpu().cannot_compute_in(DType::bf16).empty(); }

// v rounded to bfloat16 (to nearest even, as the backends round) and widened back to float.
inline float bf16_value(float v) {
  return std::bit_cast<float>(f32_bits_from_bf16(bf16_from_f32_bits(std::bit_cast<std::uint32_t>(v))));
}

// n floats drawn uniformly from [lo, hi), the same for a given seed.
inline std::vector<float> uniform(std::size_t n, float lo, float hi, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// A layer that passes its input through, for a test that registers a probe kernel of its own under
// OptionsT::kind (what the kernel records is the test's point).
template <class OptionsT>
class IdentityLayer final : public nn::Layer {
 public:
  using Options = OptionsT;
  IdentityLayer(std::string name, const Options&) : Layer(std::move(name)) {}
  std::string_view kind() const override { return Options::kind; }
  void reference_forward(const nn::ReferenceForward& io, const nn::StepContext&) const override {
    std::copy(io.x.begin(), io.x.end(), io.y.begin());
  }
  void reference_backward(const nn::ReferenceBackward& io, const nn::StepContext&) const override {
    std::copy(io.dy.begin(), io.dy.end(), io.dx.begin());
  }

 private:
  Shape build_layer(const Shape& input_shape) override { return input_shape; }
};

// Conv2D's options: `filters` square k x k filters at stride s (the layer tests' shorthand).
inline nn::Conv2DOptions conv_options(int filters, int k, int s, config::Padding p, config::Activation a,
                                      bool bias = true) {
  nn::Conv2DOptions c;
  c.filters = filters;
  c.kernel_size = {k, k};
  c.strides = {s, s};
  c.padding = p;
  c.activation = a;
  c.use_bias = bias;
  return c;
}

// A training (or inference) step of one replica alone.
inline nn::StepContext step_of(nn::Mode mode, std::int64_t samples = 0) {
  nn::StepContext step;
  step.mode = mode;
  step.step_samples = samples;
  return step;
}

// A fresh directory under the system's temporary directory, removed with the object; `what`
// names the test in the directory's name.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& what) {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("dtrain_test_" + what + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace dtrain::testing
