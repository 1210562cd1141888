// A run's directory: <run dir>/config.yaml, metrics.jsonl, evaluator.jsonl and checkpoints/ (or
// checkpoint.dir). A new run never writes into one that already holds a run: the default directory
// runs/<name> becomes runs/<name>-2, -3, ... (the first that holds none), and a directory the user
// named is refused (exit 2) with how to keep, continue or replace it; `--overwrite` replaces it.
#pragma once

#include <string>
#include <vector>

#include "config/experiment.hpp"

namespace dtrain::checkpoint {

// Where a run keeps its checkpoints: an absolute checkpoint.dir as it is; a relative one (the
// default is `checkpoints`) inside the run directory, whatever the current directory. Empty for a
// relative one without a run directory.
std::string checkpoint_dir_of(const std::string& run_dir, const config::CheckpointConfig& checkpoint);

// The reverse, for a checkpoint file named alone (`dtrain resume --checkpoint FILE`): the run
// directory that holds it under a relative checkpoint.dir; for an absolute one (or one that leaves
// the run directory with `..`) the directory above the file's.
std::string run_dir_of_checkpoint(const std::string& checkpoint_file, const config::CheckpointConfig& checkpoint);

// The files of an earlier run that a new run into `run_dir` (checkpoints in `checkpoint_dir`)
// would overwrite or prune: its config.yaml, metrics.jsonl, evaluator.jsonl, checkpoint manifest
// and ckpt-*.h5 files. Empty when there are none.
std::vector<std::string> earlier_run_files(const std::string& run_dir, const std::string& checkpoint_dir);

// ConfigError naming the run directory, what it holds, --run-dir, `dtrain resume` and
// --overwrite, when earlier_run_files() is not empty; when only a checkpoint directory outside the
// run directory holds checkpoints, naming it and checkpoint.dir instead (resuming this run
// directory could not continue them).
void refuse_to_overwrite(const std::string& run_dir, const std::string& checkpoint_dir);

// 0 when `base` holds no run, else the smallest n >= 2 such that "<base>-<n>" holds none (its
// checkpoint directory counted when it lies inside it).
int free_run_number(const std::string& base, const config::CheckpointConfig& checkpoint);
// "<base>-<n>", or base for 0.
std::string numbered_run_dir(const std::string& base, int number);

// --overwrite: removes those files (IoError when one cannot be removed), nothing else.
void remove_earlier_run(const std::string& run_dir, const std::string& checkpoint_dir);

}  // namespace dtrain::checkpoint
