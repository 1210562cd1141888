#include "nn/dropout.hpp"

#include <algorithm>
#include <vector>

#include "nn/reference/dropout.hpp"
#include "nn/registry.hpp"

namespace dtrain::nn {

namespace {

config::LayerOptions parse(const config::Section& s) {
  DropoutOptions d;
  const config::Node& rate = s.require("rate");
  d.rate = config::read_number(rate, s.path("rate"));
  if (!config::unit_interval_open(d.rate)) config::range_error(rate, s.path("rate"), "in [0, 1)");
  return d;
}

void write(const config::LayerOptions& options, config::OptionsWriter& out) {
  out.number("rate", options_as<DropoutOptions>(options).rate);
}

const LayerRegistration<Dropout> registered(
    {.kind = "dropout", .aliases = {}, .auto_name = "dropout", .keys = {"rate"}, .parse = &parse, .write = &write});

}  // namespace

void dropout_mask(std::uint64_t seed, std::int64_t global_step, std::int64_t sample_id, std::uint32_t layer,
                  double rate, std::int64_t elements, std::uint8_t* keep) {
  const std::uint32_t threshold = dropout_threshold(rate);
  for (std::int64_t e = 0; e < elements; e += 4) {
    const auto bits = sample_bits(seed, RngStream::dropout, static_cast<std::uint64_t>(global_step),
                                  static_cast<std::uint64_t>(sample_id), layer, static_cast<std::uint32_t>(e / 4));
    for (std::int64_t k = 0; k < 4 && e + k < elements; ++k) keep[e + k] = bits[static_cast<std::size_t>(k)] >= threshold;
  }
}

void Dropout::masks(const StepContext& step, std::int64_t batch, std::uint8_t* keep) const {
  const std::int64_t elements = output_shape().numel();
  for (std::int64_t i = 0; i < batch; ++i)
    dropout_mask(step.seed, step.global_step, sample_id(step, i), static_cast<std::uint32_t>(position()), opt_.rate,
                 elements, keep + i * elements);
}

void Dropout::reference_forward(const ReferenceForward& io, const StepContext& step) const {
  if (!step.training()) {
    std::copy(io.x.begin(), io.x.end(), io.y.begin());
    return;
  }
  std::vector<std::uint8_t> keep(io.x.size());
  masks(step, io.batch, keep.data());
  reference::dropout_forward(io.x.data(), keep.data(), io.y.data(), static_cast<std::int64_t>(io.x.size()), opt_.rate);
}

void Dropout::reference_backward(const ReferenceBackward& io, const StepContext& step) const {
  std::vector<std::uint8_t> keep(io.dy.size());
  masks(step, io.batch, keep.data());
  reference::dropout_backward(io.dy.data(), keep.data(), io.dx.data(), static_cast<std::int64_t>(io.dy.size()),
                              opt_.rate);
}

Flops Dropout::flops_per_sample() const {
  // A multiply per element each way (drawing the mask is not counted).
  const double n = static_cast<double>(input_shape().numel());
  return {.forward = n, .backward_data = n};
}

}  // namespace dtrain::nn
