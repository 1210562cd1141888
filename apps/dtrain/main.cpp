// dtrain: the command line. Subcommands live in cmd_*.cpp; this file parses arguments and maps
// exceptions to the exit codes of commands.hpp.
#include <charconv>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>
#include <new>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "commands.hpp"
#include "config/parse.hpp"
#include "core/error.hpp"
#include "dtrain/build_info.hpp"

namespace {

constexpr const char* kExamples = R"(
Examples:
  dtrain run experiments/fashion_mnist.yaml
  dtrain run experiments/fashion_mnist.yaml --set train.epochs=1 --set data.batch_size_per_replica=128
  dtrain run experiments/regression_toy.yaml --run-dir /tmp/toy
  dtrain validate experiments/fashion_mnist.yaml
  dtrain eval --checkpoint runs/fashion_mnist/checkpoints/ckpt-9380.h5
  dtrain export runs/fashion_mnist/checkpoints/ckpt-9380.h5 -o fashion_mnist.onnx
  dtrain export runs/fashion_mnist/checkpoints/ckpt-9380.h5 --format keras -o fashion_mnist.weights.h5
  dtrain order experiments/fashion_mnist.yaml -o order.npy
  dtrain resume runs/fashion_mnist
  dtrain resume runs/fashion_mnist --set train.epochs=15
  dtrain info
  dtrain init --strategy mirrored -o my_experiment.yaml
  dtrain plot runs/fashion_mnist runs/fashion_mnist-2 -o curves.png
  dtrain bench experiments/fashion_mnist.yaml --steps 100 --json

Exit codes: 0 ok, 1 internal error (a bug), 2 bad experiment/arguments/input data/checkpoint,
3 cannot write outputs, 4 stopped by SIGINT/SIGTERM after saving a checkpoint (dtrain resume goes on),
5 a collective between MPI workers timed out (the job was aborted).
Several processes: mpirun -n 4 dtrain run experiments/fashion_mnist_multi_worker.yaml)";

// A whole number of at least `minimum`, stated that way when it is not: CLI11's PositiveNumber
// and NonNegativeNumber print their range with the largest double written out (309 digits).
CLI::Validator at_least(long long minimum) {
  return CLI::Validator(
      [minimum](std::string& text) -> std::string {
        // from_chars, not CLI11's conversion: that one saturates a number past 64 bits silently.
        long long value = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (error == std::errc::result_out_of_range)
          return fmt::format("must be a whole number from {} to {}, got '{}'", minimum,
                             std::numeric_limits<long long>::max(), text);
        if (error != std::errc() || end != text.data() + text.size() || value < minimum)
          return fmt::format("must be a whole number of at least {}, got '{}'", minimum, text);
        return {};
      },
      fmt::format("INT>={}", minimum));
}

}  // namespace

namespace dtrain::app {

int exit_code_for(const std::exception& error) {
  if (const auto* e = dynamic_cast<const dtrain::Error*>(&error)) {
    switch (e->kind()) {
      case dtrain::ErrorKind::config:
      case dtrain::ErrorKind::input: return kBadInput;
      case dtrain::ErrorKind::io: return kIoError;
      case dtrain::ErrorKind::internal: return kInternalError;
      case dtrain::ErrorKind::peer_lost: return kCollectiveTimeout;
      case dtrain::ErrorKind::stopped: return kInterrupted;
    }
  }
  return kInternalError;
}

}  // namespace dtrain::app

int main(int argc, char** argv) {
  CLI::App app{"dtrain: tf.distribute-style custom training loops in C++, driven by YAML experiments"};
  app.footer(kExamples);
  app.set_version_flag("--version", fmt::format("dtrain {}", dtrain::build_info::version));
  app.require_subcommand(1);

  dtrain::app::RunArgs run_args;
  auto* run = app.add_subcommand("run", "Train an experiment and print the per-epoch loss and metrics");
  run->add_option("experiment", run_args.experiment, "Experiment YAML file")->required();
  run->add_option("--set", run_args.overrides, "Override a setting: --set train.epochs=3 (repeatable)");
  run->add_option("--run-dir", run_args.run_dir, "Directory for config.yaml and metrics.jsonl (default runs/<name>)");
  run->add_flag("--overwrite", run_args.overwrite,
                "Replace the run already in the run directory (without it, such a run is kept and dtrain refuses)");

  dtrain::app::ValidateArgs validate_args;
  auto* validate = app.add_subcommand("validate", "Check an experiment and print it fully resolved");
  validate->add_option("experiment", validate_args.experiment, "Experiment YAML file")->required();
  validate->add_option("--set", validate_args.overrides, "Override a setting (repeatable)");

  dtrain::app::EvalArgs eval_args;
  auto* eval = app.add_subcommand("eval", "Evaluate a checkpoint (default strategy) and print its loss and accuracy");
  eval->add_option("--checkpoint", eval_args.checkpoint, "Checkpoint file (runs/<name>/checkpoints/ckpt-N.h5)")->required();
  eval->add_option("--experiment", eval_args.experiment, "Experiment YAML (default: the one stored in the checkpoint)");
  eval->add_option("--split", eval_args.split, "Which split to evaluate")->check(CLI::IsMember({"test", "validation", "train"}));
  eval->add_option("--set", eval_args.overrides, "Override a setting (repeatable)");
  eval->add_option("--predictions", eval_args.predictions,
                   "Also write every sample's inputs, logits and labels of the split to this HDF5 file");

  dtrain::app::ExportArgs export_args;
  auto* export_cmd = app.add_subcommand(
      "export", "Write a checkpoint's model as an ONNX graph (inference mode) or its weights for Keras 3");
  export_cmd->add_option("checkpoint", export_args.checkpoint,
                         "Checkpoint file (runs/<name>/checkpoints/ckpt-N.h5); left out, with --experiment: the model "
                         "as the experiment initializes it, before the first step");
  export_cmd->add_option("-o,--output", export_args.output,
                         "The file to write (replaced if it exists): MODEL.onnx, or NAME.weights.h5 for --format keras")
      ->required();
  export_cmd->add_option("--format", export_args.format,
                         "onnx (the inference graph, default) or keras (a Keras 3 weights file for model.load_weights)")
      ->check(CLI::IsMember({"onnx", "keras"}));
  export_cmd->add_option("--experiment", export_args.experiment,
                         "Experiment YAML (default: the one stored in the checkpoint)");
  export_cmd->add_option("--set", export_args.overrides, "Override a setting (repeatable)");
  export_cmd->add_flag("--softmax", export_args.softmax,
                       "onnx: append a Softmax over the last axis: the output 'probabilities' instead of 'logits'");

  dtrain::app::OrderArgs order_args;
  auto* order = app.add_subcommand(
      "order", "Write the order in which a run of the experiment takes its training samples, epoch by epoch (.npy)");
  order->add_option("experiment", order_args.experiment, "Experiment YAML")->required();
  order->add_option("-o,--output", order_args.output,
                    "The .npy file to write (replaced if it exists): int64, one row of sample indices per epoch")
      ->required();
  order->add_option("--epochs", order_args.epochs, "How many epochs (default: the experiment's train.epochs)")
      ->check(CLI::Range(1LL, 1000000LL));
  order->add_option("--set", order_args.overrides, "Override a setting (repeatable)");

  dtrain::app::ResumeArgs resume_args;
  auto* resume = app.add_subcommand("resume", "Continue a run exactly from its newest valid checkpoint");
  resume->add_option("run_dir", resume_args.run_dir, "Run directory (runs/<name>)");
  resume->add_option("--checkpoint", resume_args.checkpoint, "Continue from this checkpoint file instead");
  resume->add_option("--set", resume_args.overrides,
                     "Override a setting: train.epochs=N extends the run; others are listed in a warning");

  auto* info = app.add_subcommand("info", "Versions, CPU ISA, threads and which backends are available");

  dtrain::app::InitArgs init_args;
  std::vector<std::string> strategy_kinds;
  for (std::string_view kind : dtrain::config::choices_of("strategy.kind")) strategy_kinds.emplace_back(kind);
  auto* init = app.add_subcommand("init", "Write a complete, commented experiment to start from");
  init->add_option("--strategy", init_args.strategy, "Strategy kind")
      ->check(CLI::IsMember(strategy_kinds));
  init->add_option("--model", init_args.model, "cnn (the seed CNN) or mlp")->check(CLI::IsMember({"cnn", "mlp"}));
  init->add_option("-o,--output", init_args.output, "Write to FILE instead of stdout (never over an existing file)");
  init->add_flag("--force", init_args.force, "Replace an existing -o FILE");

  dtrain::app::PlotArgs plot_args;
  auto* plot = app.add_subcommand("plot", "Draw the loss, accuracy and samples/s per epoch of runs into a PNG");
  plot->add_option("run_dirs", plot_args.run_dirs, "Run directories (each with metrics.jsonl)")->required();
  plot->add_option("-o,--output", plot_args.output, "PNG file (default RUN_DIR/curves.png, or curves.png for several)");
  dtrain::app::BenchArgs bench_args;
  auto* bench = app.add_subcommand(
      "bench", "Time an experiment's training steps: per layer, per phase, samples/s and GFLOP/s against the GEMM peak");
  bench->add_option("experiment", bench_args.experiment, "Experiment YAML file")->required();
  bench->add_option("--set", bench_args.overrides, "Override a setting (repeatable)");
  bench->add_option("--steps", bench_args.steps, "Timed training steps")->capture_default_str()->check(at_least(1));
  bench->add_option("--warmup", bench_args.warmup, "Untimed steps before them")->capture_default_str()->check(at_least(0));
  bench->add_flag("--json", bench_args.json, "Print one JSON object (schema dtrain.bench/1) instead of the table");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "dtrain: error: {}; run 'dtrain --help' for usage\n", e.what());
    return dtrain::app::kBadInput;
  }

  try {
    if (*run) return dtrain::app::run_command(run_args);
    if (*validate) return dtrain::app::validate_command(validate_args);
    if (*eval) return dtrain::app::eval_command(eval_args);
    if (*export_cmd) return dtrain::app::export_command(export_args);
    if (*order) return dtrain::app::order_command(order_args);
    if (*resume) return dtrain::app::resume_command(resume_args);
    if (*info) return dtrain::app::info_command();
    if (*init) return dtrain::app::init_command(init_args);
    if (*plot) return dtrain::app::plot_command(plot_args);
    if (*bench) return dtrain::app::bench_command(bench_args);
  } catch (const dtrain::Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "dtrain: error: {}\n", e.what());
    return dtrain::app::exit_code_for(e);
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    // Sizes the machine cannot hold are refused before allocating (docs/experiment.md, "Limits"); one that
    // still fails is the experiment's too: say which keys decide the memory.
    fmt::print(stderr, "dtrain: error: out of memory; choose a smaller data.batch_size_per_replica (or "
                       "global_batch_size, eval_batch_size) or smaller layers in model.layers\n");
    return dtrain::app::kBadInput;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "dtrain: internal error: {} (please report this)\n", e.what());
    return dtrain::app::kInternalError;
  }
  return dtrain::app::kInternalError;
}
