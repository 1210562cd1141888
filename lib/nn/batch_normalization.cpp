#include "nn/batch_normalization.hpp"

#include <vector>

#include <fmt/format.h>

#include "nn/reference/batch_normalization.hpp"
#include "nn/registry.hpp"

namespace dtrain::nn {

namespace {

config::LayerOptions parse(const config::Section& s) {
  BatchNormalizationOptions b;
  s.get_number("momentum", b.momentum, config::unit_interval_open, "in [0, 1)");
  s.get_number("epsilon", b.epsilon, config::positive, "> 0");
  s.get_bool("center", b.center);
  s.get_bool("scale", b.scale);
  s.get_bool("synchronized", b.synchronized);
  return b;
}

void write(const config::LayerOptions& options, config::OptionsWriter& out) {
  const auto& b = options_as<BatchNormalizationOptions>(options);
  out.number("momentum", b.momentum);
  out.number("epsilon", b.epsilon);
  out.boolean("center", b.center);
  out.boolean("scale", b.scale);
  out.boolean("synchronized", b.synchronized);
}

const LayerRegistration<BatchNormalization> registered(
    {.kind = "batch_normalization",
     .aliases = {},
     .auto_name = "batch_normalization",
     .keys = {"momentum", "epsilon", "center", "scale", "synchronized"},
     .parse = &parse,
     .write = &write});

// The data as rows x channels.
std::int64_t rows_of(const Shape& per_example, std::int64_t batch) {
  return batch * (per_example.numel() / per_example[per_example.rank() - 1]);
}

}  // namespace

Shape BatchNormalization::build_layer(const Shape& in) {
  if (in.rank() < 1)
    throw ConfigError(fmt::format("layer '{}': batch_normalization needs an input with a channel axis", name()));
  const Shape channels{in[in.rank() - 1]};
  if (opt_.scale) add_variable("gamma", channels, Initializer::ones());
  if (opt_.center) add_variable("beta", channels);
  add_variable("moving_mean", channels, Initializer::zeros(), /*trainable=*/false);
  add_variable("moving_variance", channels, Initializer::ones(), /*trainable=*/false);
  return in;
}

double BatchNormalization::contribution_weight(const StepContext& step, std::int64_t batch) const {
  // Synchronized, every replica and lane holds the global statistics: one of them contributes.
  if (opt_.synchronized) return step.replica == 0 && step.lane == 0 ? 1.0 : 0.0;
  const std::int64_t samples = step.step_samples > 0 ? step.step_samples : batch;
  return static_cast<double>(batch) / static_cast<double>(samples);
}

void BatchNormalization::apply_updates(device::Numerics& numerics) {
  const auto momentum = static_cast<float>(opt_.momentum);
  const auto take = static_cast<float>(1.0 - opt_.momentum);
  for (const std::size_t i : {moving_mean_index(), moving_variance_index()}) {
    Variable& v = variables()[i];
    numerics.axpby(take, v.grad.address<float>(), momentum, v.value.address<float>(), static_cast<std::size_t>(channels()));
  }
}

void BatchNormalization::reference_forward(const ReferenceForward& io, const StepContext& step) const {
  const std::int64_t m = rows_of(input_shape(), io.batch), c = channels();
  const double* gamma = opt_.scale ? io.variables[static_cast<std::size_t>(gamma_index())].data() : nullptr;
  const double* beta = opt_.center ? io.variables[static_cast<std::size_t>(beta_index())].data() : nullptr;
  std::vector<double> mean(static_cast<std::size_t>(c)), variance(static_cast<std::size_t>(c));
  if (step.training()) {
    reference::batch_norm_statistics(io.x.data(), m, c, mean.data(), variance.data());
  } else {
    mean = io.variables[moving_mean_index()];
    variance = io.variables[moving_variance_index()];
  }
  reference::batch_norm_forward(io.x.data(), m, c, mean.data(), variance.data(), gamma, beta, opt_.epsilon, io.y.data());
}

void BatchNormalization::reference_backward(const ReferenceBackward& io, const StepContext& step) const {
  const std::int64_t m = rows_of(input_shape(), io.batch), c = channels();
  const double* gamma = opt_.scale ? io.variables[static_cast<std::size_t>(gamma_index())].data() : nullptr;
  double* dgamma = opt_.scale ? io.dvariables[static_cast<std::size_t>(gamma_index())].data() : nullptr;
  double* dbeta = opt_.center ? io.dvariables[static_cast<std::size_t>(beta_index())].data() : nullptr;
  std::vector<double> mean(static_cast<std::size_t>(c)), variance(static_cast<std::size_t>(c));
  reference::batch_norm_statistics(io.x.data(), m, c, mean.data(), variance.data());
  reference::batch_norm_backward_training(io.x.data(), io.dy.data(), m, c, mean.data(), variance.data(), gamma,
                                          opt_.epsilon, io.dx.data(), dgamma, dbeta);
  // The moving statistics' update contributions.
  const double weight = contribution_weight(step, io.batch);
  for (std::int64_t k = 0; k < c; ++k) {
    io.dvariables[moving_mean_index()][static_cast<std::size_t>(k)] = mean[static_cast<std::size_t>(k)] * weight;
    io.dvariables[moving_variance_index()][static_cast<std::size_t>(k)] = variance[static_cast<std::size_t>(k)] * weight;
  }
}

Flops BatchNormalization::flops_per_sample() const {
  // Training: the statistics (3 per element), normalize (2) and scale and shift (2); backward
  // about the same through the statistics, and 2 per element for the gradients of gamma and beta.
  const double n = static_cast<double>(input_shape().numel());
  return {.forward = 7.0 * n, .backward_data = 7.0 * n, .backward_weights = 2.0 * n};
}

}  // namespace dtrain::nn
