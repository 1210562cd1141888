#include <fmt/format.h>

#include "commands.hpp"
#include "device/context.hpp"
#include "config/model_checks.hpp"
#include "config/parse.hpp"
#include "nn/model.hpp"

namespace dtrain::app {

int validate_command(const ValidateArgs& args) {
  config::Experiment exp = config::load_experiment(args.experiment, args.overrides);
  // Building the model checks what YAML alone cannot: that the layers fit the input shape. Its
  // kernels are made on the CPU backend, which has one for every layer kind.
  const auto ctx = device::make_context(Device{});
  nn::check_precision(exp.precision, exp.precision_where, *ctx);
  nn::Sequential model(exp.model, exp.seed, *ctx, nn::ModelOptions{nn::compute_dtype(exp.precision), false});
  config::check_loss_fits_model(exp, model.output_shape().dims());
  // A replica's batches must fit in memory (the replica count is known only at run: one is assumed).
  const config::BatchKey batch = config::batch_key(exp, false);
  model.check_batch_memory(batch.value, batch);
  if (exp.data.eval_batch_size > 0) model.check_batch_memory(exp.data.eval_batch_size, config::batch_key(exp, true));
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
