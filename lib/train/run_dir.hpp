// A run's directory: <run dir>/config.yaml, metrics.jsonl, evaluator.jsonl and checkpoints/ (or
// checkpoint.dir). A new run never writes into one that already holds a run: the default directory
// runs/<name> becomes runs/<name>-2, -3, ... (the first that holds none), and a directory the user
// named is refused (exit 2) with how to keep, continue or replace it; `--overwrite` replaces it.
#pragma once

#include <string>
#include <vector>

#include "config/experiment.hpp"

namespace dtrain::train {

// checkpoint.dir, or <run dir>/checkpoints; empty when there is neither.
std::string checkpoint_dir_of(const std::string& run_dir, const config::CheckpointConfig& checkpoint);

// The files of an earlier run that a new run into `run_dir` (checkpoints in `checkpoint_dir`)
// would overwrite or prune: its config.yaml, metrics.jsonl, evaluator.jsonl, checkpoint manifest
// and ckpt-*.h5 files. Empty when there are none.
std::vector<std::string> earlier_run_files(const std::string& run_dir, const std::string& checkpoint_dir);

// ConfigError naming the run directory, what it holds, --run-dir, `dtrain resume` and
// --overwrite, when earlier_run_files() is not empty.
void refuse_to_overwrite(const std::string& run_dir, const std::string& checkpoint_dir);

// 0 when `base` holds no run, else the smallest n >= 2 such that "<base>-<n>" holds none.
int free_run_number(const std::string& base);
// "<base>-<n>", or base for 0.
std::string numbered_run_dir(const std::string& base, int number);

// --overwrite: removes those files (IoError when one cannot be removed), nothing else.
void remove_earlier_run(const std::string& run_dir, const std::string& checkpoint_dir);

}  // namespace dtrain::train
