#include "train/evaluator.hpp"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "checkpoint/manager.hpp"
#include "core/error.hpp"

namespace dtrain::train {

namespace fs = std::filesystem;

std::string evaluator_line(const std::string& checkpoint, const checkpoint::TrainingState& state, const EvalResult& r) {
  std::string line = fmt::format("Evaluator: {} ({}, global step {}), Test Loss: {:.4f}",
                                 fs::path(checkpoint).filename().string(), checkpoint::position_in_training(state),
                                 state.global_step, r.loss);
  if (r.accuracy) line += fmt::format(", Test Accuracy: {:.2f}", *r.accuracy * 100.0);
  return line;
}

void wait_for_training(distribute::WorkerGroup& workers, const std::atomic<int>* stop_requested, double poll_seconds) {
  while (!workers.training_done() && !(stop_requested && stop_requested->load() != 0))
    std::this_thread::sleep_for(std::chrono::duration<double>(poll_seconds));
}

int run_evaluator(Trainer& trainer, distribute::WorkerGroup& workers, const EvaluatorOptions& options) {
  const std::string dir = trainer.checkpoint_dir();
  if (dir.empty()) throw ConfigError("the evaluator needs a checkpoint directory: give a run directory or checkpoint.dir");
  fmt::print(options.out, "Evaluator: watching {} for checkpoints\n", dir);
  std::fflush(options.out);
  std::string last;
  int evaluated = 0;
  bool finished = false;
  for (;;) {
    // Asked before listing, so a checkpoint saved just before the chief's notice is still seen.
    finished = finished || workers.training_done();
    std::vector<std::string> listed;
    try {
      listed = checkpoint::list_checkpoints(dir);
    } catch (const InputError& e) {
      fmt::print(stderr, "dtrain: warning: evaluator: {}\n", e.what());
    }
    if (!listed.empty() && listed.back() != last) {
      last = listed.back();
      try {
        const checkpoint::TrainingState state = trainer.restore(last);
        const EvalResult result = trainer.evaluate_split("test");
        const std::string line = evaluator_line(last, state, result);
        fmt::print(options.out, "{}\n", line);
        std::fflush(options.out);
        ++evaluated;
        if (!options.run_dir.empty()) {
          std::ofstream jsonl(fs::path(options.run_dir) / "evaluator.jsonl", std::ios::app);
          jsonl << fmt::format("{{\"checkpoint\": \"{}\", \"epochs_completed\": {}, \"step_in_epoch\": {}, \"global_step\": {}, "
                               "\"test_loss\": {:.8g}, \"test_accuracy\": {}, \"test_samples\": {}}}\n",
                               fs::path(last).filename().string(), state.epoch, state.step_in_epoch, state.global_step,
                               result.loss, result.accuracy ? fmt::format("{:.8g}", *result.accuracy) : "null",
                               result.samples);
        }
      } catch (const InputError& e) {
        fmt::print(stderr, "dtrain: warning: evaluator: skipping {}: {}\n", last, e.what());
      }
      continue;  // look again at once: more may have arrived while this one was evaluated
    }
    if (finished || (options.stop_requested && options.stop_requested->load() != 0)) break;
    std::this_thread::sleep_for(std::chrono::duration<double>(options.poll_seconds));
  }
  return evaluated;
}

}  // namespace dtrain::train
