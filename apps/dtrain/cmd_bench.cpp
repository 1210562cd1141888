// dtrain bench EXPERIMENT: the experiment's training steps timed, per layer and per phase (like
// `caffe time`), with the GEMM peak of the same cores measured in the same run.
#include <cstdio>
#include <cstdlib>
#include <memory>

#include <fmt/format.h>

#include "commands.hpp"
#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/roles.hpp"
#include "distribute/strategy.hpp"
#include "distribute/worker_group.hpp"
#include "observe/bench.hpp"
#include "train/trainer.hpp"

namespace dtrain::app {

int bench_command(const BenchArgs& args) {
  const std::unique_ptr<distribute::WorkerGroup> workers = distribute::make_worker_group();
  return run_as_worker(*workers, [&] {
    config::Experiment exp =
        load_on_every_rank(*workers, [&] { return config::load_experiment(args.experiment, args.overrides); });
    refuse_local_strategy_under_launcher(exp, *workers, "each would time its own steps alone on the shared cores "
                                                        "and print its own table");
    if (const config::RolesConfig* written = distribute::roles_of(exp.strategy)) {
      const auto roles = workers->assign_roles(*written, std::getenv("TF_CONFIG"));
      if (roles && roles->evaluators > 0)  // every rank's roles agree: each refuses, the chief reports
        throw JobConfigError(fmt::format("{}: dtrain bench times training steps, and the evaluator role runs none; leave it "
                                      "out (--set strategy.roles.evaluator=0)",
                                      exp.source_file));
    }
    train::TrainerOptions options;
    options.workers = workers.get();
    options.out = stdout;
    train::Trainer trainer(std::move(exp), options);
    start_from_initial_weights(trainer);
    if (trainer.strategy().schedules_steps())
      throw ConfigError(fmt::format("{}: dtrain bench times the synchronous training step, and this strategy schedules "
                                    "its own steps; bench it under {}{}a local strategy",
                                    trainer.experiment().source_file,
                                    fmt::join(distribute::kinds_spanning_workers(true), ", "),
                                    distribute::kinds_spanning_workers(true).empty() ? "" : " or "));
    const bool chief = trainer.strategy().is_chief();
    if (chief && !args.json) {
      // Before the steps, so that a long bench shows at once what it measures.
      fmt::print("{}\n", trainer.header_line());
      std::fflush(stdout);
    }
    observe::BenchOptions bench;
    bench.warmup = args.warmup;
    bench.steps = args.steps;
    observe::BenchReport report = observe::run_bench(trainer, bench);
    if (chief) {
      if (args.json) {
        fmt::print("{}", observe::bench_json(report));
      } else {
        fmt::print("{}", observe::bench_table(report));
      }
      std::fflush(stdout);
    }
    return kOk;
  });
}

}  // namespace dtrain::app
