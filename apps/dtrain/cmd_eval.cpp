#include <filesystem>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "checkpoint/checkpoint.hpp"
#include "commands.hpp"
#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/strategy.hpp"
#include "distribute/worker_group.hpp"
#include "train/callbacks.hpp"
#include "train/trainer.hpp"

namespace dtrain::app {

int naming_source(const std::string& source, const std::function<int()>& body) {
  try {
    return body();
  } catch (const train::TrainingDiverged&) {
    throw;
  } catch (const JobConfigError& e) {
    // Still the job's (every rank has it, the chief reports it) or each rank's own.
    if (std::string(e.what()).find(source) != std::string::npos) throw;
    throw JobConfigError(fmt::format("{}: {}", source, e.what()), e.reported_by);
  } catch (const ConfigError& e) {
    if (std::string(e.what()).find(source) != std::string::npos) throw;
    throw ConfigError(fmt::format("{}: {}", source, e.what()));
  }
}

void refuse_writing_onto(const std::string& output, const char* option, std::vector<std::string> inputs,
                         const config::Experiment& experiment) {
  if (output.empty()) return;
  inputs.push_back(experiment.data.path);
  inputs.insert(inputs.end(), experiment.data.shards.begin(), experiment.data.shards.end());
  for (const std::string& input : inputs) {
    std::error_code error;
    if (input.empty() || !std::filesystem::equivalent(output, input, error)) continue;
    throw ConfigError(fmt::format("{} {} is {}, which this command reads: writing there would replace it; choose "
                                  "another file",
                                  option, output, input));
  }
}

int eval_command(const EvalArgs& args) {
  const std::unique_ptr<distribute::WorkerGroup> workers = distribute::make_worker_group();
  return run_as_worker(*workers, [&] {
    // The model comes from the experiment stored in the checkpoint, unless one is given.
    checkpoint::Contents stored;
    config::Experiment exp = load_on_every_rank(*workers, [&] {
      stored = checkpoint::peek(args.checkpoint);
      return args.experiment.empty()
                 ? config::parse_experiment(stored.experiment_yaml, args.checkpoint + ":/experiment", args.overrides)
                 : config::load_experiment(args.experiment, args.overrides);
    });
    refuse_writing_onto(args.predictions, "--predictions", {args.checkpoint, args.experiment}, exp);
    // Evaluate with the global batch training evaluated with: the per-example results, so the
    // printed figures, are those training printed. (A multi-worker experiment's replicas are
    // counted in this job's workers: the checkpoint does not say how many trained.)
    if (exp.data.eval_batch_size == 0)
      exp.data.eval_batch_size =
          exp.data.global_batch_size > 0
              ? exp.data.global_batch_size
              : exp.data.batch_size_per_replica *
                    distribute::num_replicas_in_sync(exp.strategy, train::resolve_threads(exp.train.threads),
                                                     workers->size());
    // One process evaluates on the default strategy; under an MPI launcher the workers split the
    // split exactly (no padding, no duplicates) and combine exact counts.
    exp.strategy = distribute::evaluation_strategy(workers->size());
    // --predictions: the chief writes every sample of the split, which under auto_shard: file it
    // does not hold (only its own files): every rank then reads every file and the workers split
    // the samples (by data), with the same figures.
    if (!args.predictions.empty() && workers->size() > 1 && !exp.data.shards.empty())
      exp.data.auto_shard = config::AutoShardPolicy::data;
    if (args.split == "validation" && exp.data.validation_split <= 0.0)
      throw ConfigError(
          fmt::format("--split validation: the experiment has no validation_split; use --split test or train"));

    train::TrainerOptions options;
    options.out = stdout;
    options.workers = workers.get();
    options.purpose = train::TrainerOptions::Purpose::evaluate;
    const std::string source = args.experiment.empty() ? args.checkpoint + ":/experiment" : args.experiment;
    std::unique_ptr<train::Trainer> built;
    naming_source(source, [&] {
      built = std::make_unique<train::Trainer>(std::move(exp), options);
      return 0;
    });
    train::Trainer& trainer = *built;
    checkpoint::restore_model(args.checkpoint, trainer.model());
    // Evaluating reads no /state figures, but a file holding corrupt ones is refused as resume
    // refuses it. They belong to the stored experiment; with --experiment, one that no longer
    // reads has nothing to check them against.
    std::optional<config::Experiment> written_with;
    if (args.experiment.empty()) {
      written_with = trainer.experiment();
    } else {
      try {
        written_with = config::parse_experiment(stored.experiment_yaml, args.checkpoint + ":/experiment");
      } catch (const ConfigError&) {
      }
    }
    if (written_with) trainer.check_stored_state(args.checkpoint, stored.state, *written_with);
    const train::EvalResult r = trainer.evaluate_split(args.split);
    const char* label = args.split == "test" ? "Test" : args.split == "validation" ? "Validation" : "Train";
    if (!trainer.strategy().is_chief()) return static_cast<int>(kOk);
    fmt::print("Checkpoint {} ({}, global step {})\n", args.checkpoint, checkpoint::position_in_training(stored.state),
               stored.state.global_step);
    std::string line = fmt::format("{} Loss: {:.4f}", label, r.loss);
    if (r.accuracy) line += fmt::format(", {} Accuracy: {:.2f}", label, 100.0 * *r.accuracy);
    fmt::print("{}\n  {} samples, {:.2f} s\n", line, r.samples, r.seconds);
    if (!args.predictions.empty()) {
      // The chief alone, over the whole split, with the batch evaluation used.
      train::write_predictions(args.predictions, trainer.predict_split(args.split, trainer.experiment().data.eval_batch_size),
                               args.split, args.checkpoint);
      fmt::print("  predictions of {} samples written to {}\n", r.samples, args.predictions);
    }
    return static_cast<int>(kOk);
  });
}

}  // namespace dtrain::app
