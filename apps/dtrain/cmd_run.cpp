#include <unistd.h>

#include <cstdio>

#include <fmt/format.h>

#include "commands.hpp"
#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/cluster.hpp"
#include "signals.hpp"
#include "train/trainer.hpp"

namespace dtrain::app {

int run_as_worker(distribute::Cluster& cluster, const std::function<int()>& body) {
  if (cluster.size() == 1) return body();
  try {
    return body();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "dtrain: error: rank {}: {}\n", cluster.rank(), e.what());
    cluster.abort(exit_code_for(e));
  }
}

int report_interrupted(const train::Interrupted& stop, const std::string& run_dir) {
  std::fflush(stdout);
  if (stop.checkpoint.empty() && !run_dir.empty()) return kInterrupted;  // a worker other than the chief
  fmt::print(stderr, "dtrain: stopped at epoch {}, step {} of it; checkpoint {}\ndtrain: continue with: dtrain resume {}\n",
             stop.epoch + 1, stop.step_in_epoch, stop.checkpoint.empty() ? "(none: no run directory)" : stop.checkpoint,
             run_dir);
  return kInterrupted;
}

int run_command(const RunArgs& args) {
  distribute::Cluster cluster;
  return run_as_worker(cluster, [&] {
  config::Experiment exp = config::load_experiment(args.experiment, args.overrides);
  train::TrainerOptions options;
  options.cluster = &cluster;
  options.run_dir = args.run_dir.empty() ? "runs/" + exp.name : args.run_dir;
  options.out = stdout;
  options.out_is_tty = isatty(fileno(stdout)) != 0;
  StopOnSignal signals;
  options.stop_requested = &signals.requested();
  train::Trainer trainer(std::move(exp), options);
  try {
    trainer.fit();
  } catch (const train::Interrupted& stop) {
    return report_interrupted(stop, options.run_dir);
  }
  return static_cast<int>(kOk);
  });
}

}  // namespace dtrain::app
