#include <unistd.h>

#include <cstdio>

#include "commands.hpp"
#include "config/parse.hpp"
#include "train/trainer.hpp"

namespace dtrain::app {

int run_command(const RunArgs& args) {
  config::Experiment exp = config::load_experiment(args.experiment, args.overrides);
  train::TrainerOptions options;
  options.run_dir = args.run_dir.empty() ? "runs/" + exp.name : args.run_dir;
  options.out = stdout;
  options.out_is_tty = isatty(fileno(stdout)) != 0;
  train::Trainer trainer(std::move(exp), options);
  trainer.fit();
  return kOk;
}

}  // namespace dtrain::app
