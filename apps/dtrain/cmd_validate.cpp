#include <fmt/format.h>

#include "commands.hpp"
#include "backends/context.hpp"
#include "config/model_checks.hpp"
#include "config/parse.hpp"
#include "core/machine.hpp"
#include "nn/model.hpp"

namespace dtrain::app {

int validate_command(const ValidateArgs& args) {
  config::Experiment exp = config::load_experiment(args.experiment, args.overrides);
  // Building the model checks what YAML alone cannot: that the layers fit the input shape. Its
  // kernels are made on the CPU backend, which has one for every layer kind.
  const auto ctx = backends::make_context(Device{});
  nn::check_precision(exp.precision, exp.precision_where, *ctx);
  nn::Sequential model(exp.model, exp.seed, *ctx, nn::ModelOptions{nn::compute_dtype(exp.precision), false});
  config::check_loss_fits_model(exp, model.output_shape().dims());
  // A replica's batch must fit in memory (the replica count is known only at run: one is assumed).
  const std::int64_t batch = exp.data.global_batch_size > 0 ? exp.data.global_batch_size : exp.data.batch_size_per_replica;
  if (model.activation_bytes(batch) > physical_memory_bytes())
    throw ConfigError(fmt::format("{}: data.{} {}: a batch that large needs {} of activations, more than this "
                                  "machine's {} of memory; choose a smaller batch",
                                  exp.source_file, exp.data.global_batch_size > 0 ? "global_batch_size" : "batch_size_per_replica",
                                  batch, format_bytes(model.activation_bytes(batch)), format_bytes(physical_memory_bytes())));
  fmt::print("# {}: valid\n{}", args.experiment, config::to_yaml(exp));
  fmt::print("# model\n");
  std::string summary = model.summary();
  std::string::size_type start = 0;
  while (start < summary.size()) {
    auto end = summary.find('\n', start);
    fmt::print("#   {}\n", summary.substr(start, end - start));
    start = end == std::string::npos ? summary.size() : end + 1;
  }
  return kOk;
}

}  // namespace dtrain::app
