#include <algorithm>

#include <fmt/format.h>

#include "commands.hpp"
#include "device/context.hpp"
#include "config/model_checks.hpp"
#include "config/parse.hpp"
#include "core/checked.hpp"
#include "core/machine.hpp"
#include "data/input_context.hpp"
#include "losses/loss.hpp"
#include "distribute/strategy.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"
#include "train/memory_estimate.hpp"
#include "train/trainer.hpp"

namespace dtrain::app {

int validate_command(const ValidateArgs& args) {
  config::Experiment exp = config::load_experiment(args.experiment, args.overrides);
  // As `run` does, before any kernel: what reproducibility.isa leaves the kernels (and bfloat16).
  train::cap_instruction_set(exp);
  // Building the model checks what YAML alone cannot: that the layers fit the input shape. Its
  // kernels are made on the CPU backend, which has one for every layer kind.
  const auto ctx = device::make_context(Device{});
  nn::check_precision(exp.precision, exp.precision_where, *ctx);
  // Before any variable is allocated, the run's memory from the declared shapes, as `run` checks
  // it: this process's replicas and lanes as the strategy lays them out on this machine.
  nn::ModelOptions options{.compute = nn::compute_dtype(exp.precision),
                           .crossentropy_from_pre_activation = losses::reads_activation_input(exp.loss.kind)};
  options.before_allocating = [&](const nn::Sequential& declared) {
    const int threads = train::resolve_threads(exp.train.threads);
    train::RunCopies copies;
    copies.replicas = std::max(1, distribute::num_replicas_in_sync(exp.strategy, threads, 1));
    copies.lanes = exp.train.parallelism == config::Parallelism::batch ? std::max(1, threads / copies.replicas) : 1;
    copies.optimizer_slots = static_cast<int>(optim::make_optimizer(exp.optimizer, ctx->numerics())->slot_names().size());
    // A batch given globally is split over the replicas; one given per replica is each one's.
    copies.train_key = config::batch_key(exp, false);
    copies.eval_key = config::batch_key(exp, true);
    copies.train_batch = exp.data.global_batch_size > 0
                             ? (exp.data.global_batch_size + copies.replicas - 1) / copies.replicas
                             : exp.data.batch_size_per_replica;
    // reproducibility: replica_invariant: one lane per micro-batch of a replica's batch.
    if (exp.reproducibility.invariant())
      copies.lanes = static_cast<int>(
          std::max<std::int64_t>(2, ceil_div(copies.train_batch, exp.reproducibility.micro_batch_size)));
    copies.eval_batch = exp.data.eval_batch_size > 0 ? exp.data.eval_batch_size : copies.train_batch;
    train::check_run_memory(declared, copies, usable_memory());
  };
  nn::Sequential model(exp.model, exp.seed, *ctx, options);
  config::check_loss_fits_model(exp, model.output_shape().dims());
  // Per-replica pipelines cannot split a remainder: a global batch must divide among the replicas
  // this process lays out (under mpirun, `run` checks it against every worker's too).
  if (exp.data.distribute == config::DistributeMode::per_replica && exp.data.global_batch_size > 0) {
    const config::BatchKey key = config::batch_key(exp, false);
    try {
      data::InputContext{.num_replicas_in_sync = std::max(
                             1, distribute::num_replicas_in_sync(exp.strategy, train::resolve_threads(exp.train.threads), 1))}
          .get_per_replica_batch_size(key.value);
    } catch (const ConfigError& e) {
      throw ConfigError(key.where + e.what());
    }
  }
  // model.initial_weights is read whole, as `run` reads it, so a file that is missing, not Keras
  // weights, or of another model's shapes is refused here and not after the launch.
  const std::size_t initial_variables = read_initial_weights(exp, model).size();
  fmt::print("# {}: valid\n{}", args.experiment, config::to_yaml(exp));
  if (initial_variables > 0)
    fmt::print("# initial weights: {} holds the {} variables of the model, of their shapes\n",
               exp.model.initial_weights, initial_variables);
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
