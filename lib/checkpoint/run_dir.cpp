#include "checkpoint/run_dir.hpp"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "checkpoint/manager.hpp"
#include "core/error.hpp"

namespace dtrain::checkpoint {

namespace fs = std::filesystem;

namespace {

// Whether `path` lies in `dir` or below it (after resolving `.`, `..` and symbolic links).
bool inside(const std::string& path, const std::string& dir) {
  if (path.empty() || dir.empty()) return false;
  std::error_code path_ec, dir_ec;
  const fs::path p = fs::weakly_canonical(path, path_ec), d = fs::weakly_canonical(dir, dir_ec);
  if (path_ec || dir_ec) return false;
  const fs::path relative = p.lexically_relative(d);
  return !relative.empty() && *relative.begin() != "..";
}

}  // namespace

std::string checkpoint_dir_of(const std::string& run_dir, const config::CheckpointConfig& checkpoint) {
  // A relative checkpoint.dir is the run's, like the default `checkpoints`: resolved against the
  // run directory, never the current one, so that `dtrain resume RUN_DIR` from anywhere finds the
  // run's own checkpoints (and two runs started in different directories never share them).
  const fs::path dir(checkpoint.dir.empty() ? std::string("checkpoints") : checkpoint.dir);
  if (dir.is_absolute()) return dir.string();
  return run_dir.empty() ? std::string() : (fs::path(run_dir) / dir).string();
}

std::string run_dir_of_checkpoint(const std::string& checkpoint_file, const config::CheckpointConfig& checkpoint) {
  const fs::path file(checkpoint_file);
  const fs::path dir(checkpoint.dir.empty() ? std::string("checkpoints") : checkpoint.dir);
  fs::path run = file.parent_path();
  bool inside = !dir.is_absolute();
  for (const fs::path& part : dir.lexically_normal()) {
    if (part.empty() || part == ".") continue;
    // `..` and absolute directories lead out of the run directory: it cannot be told from the path.
    inside = inside && part != ".." && run.has_parent_path();
    if (inside) run = run.parent_path();
  }
  return (inside ? run : file.parent_path().parent_path()).string();
}

std::vector<std::string> earlier_run_files(const std::string& run_dir, const std::string& checkpoint_dir) {
  std::vector<std::string> found;
  std::error_code ec;
  if (!run_dir.empty())
    for (const char* name : {"config.yaml", "metrics.jsonl", "evaluator.jsonl"})
      if (fs::exists(fs::path(run_dir) / name, ec)) found.push_back((fs::path(run_dir) / name).string());
  // TensorBoard's event files: an --overwrite that left them would show the old run's scalars
  // among the new run's.
  if (!run_dir.empty() && fs::is_directory(fs::path(run_dir) / "tensorboard", ec)) {
    std::vector<std::string> events;
    for (const auto& entry : fs::directory_iterator(fs::path(run_dir) / "tensorboard", ec))
      if (entry.path().filename().string().starts_with("events.out.tfevents.")) events.push_back(entry.path().string());
    std::sort(events.begin(), events.end());
    found.insert(found.end(), events.begin(), events.end());
  }
  if (!checkpoint_dir.empty() && fs::is_directory(checkpoint_dir, ec)) {
    std::vector<std::string> checkpoints;
    for (const auto& entry : fs::directory_iterator(checkpoint_dir, ec)) {
      const std::string name = entry.path().filename().string();
      const bool ours = name == checkpoint::kManifestName || (name.starts_with("ckpt-") && name.ends_with(".h5"));
      if (ours) checkpoints.push_back(entry.path().string());
    }
    std::sort(checkpoints.begin(), checkpoints.end());
    found.insert(found.end(), checkpoints.begin(), checkpoints.end());
  }
  return found;
}

int free_run_number(const std::string& base, const config::CheckpointConfig& checkpoint) {
  // Only a checkpoint directory inside the run directory moves with the number; one outside is the
  // same for every number, and refuse_to_overwrite() speaks about it.
  const auto holds_a_run = [&](const std::string& run_dir) {
    const std::string checkpoints = checkpoint_dir_of(run_dir, checkpoint);
    return !earlier_run_files(run_dir, inside(checkpoints, run_dir) ? checkpoints : std::string()).empty();
  };
  if (!holds_a_run(base)) return 0;
  for (int n = 2;; ++n)
    if (!holds_a_run(numbered_run_dir(base, n))) return n;
}

std::string numbered_run_dir(const std::string& base, int number) {
  return number == 0 ? base : fmt::format("{}-{}", base, number);
}

void refuse_to_overwrite(const std::string& run_dir, const std::string& checkpoint_dir) {
  const std::vector<std::string> found = earlier_run_files(run_dir, checkpoint_dir);
  if (found.empty()) return;
  std::string listed;
  for (std::size_t i = 0; i < found.size() && i < 3; ++i) listed += (i ? ", " : "") + found[i];
  if (found.size() > 3) listed += fmt::format(" and {} more", found.size() - 3);
  // Only the checkpoints of a checkpoint.dir outside the run directory: they are another run's,
  // which `dtrain resume` of this run directory would not continue.
  if (!inside(checkpoint_dir, run_dir) && earlier_run_files(run_dir, "").empty())
    throw ConfigError(fmt::format("checkpoint.dir {} already holds another run's checkpoints ({}); this run would prune "
                                  "them: give it a checkpoint.dir of its own (a relative one lies inside its run "
                                  "directory), continue the run that wrote them with `dtrain resume` and that run's "
                                  "directory, or pass --overwrite to replace them",
                                  checkpoint_dir, listed));
  throw ConfigError(fmt::format("{} already holds a run ({}); a new run would overwrite it: give another --run-dir to "
                                "keep it, `dtrain resume {}` to continue it, or --overwrite to replace it",
                                run_dir, listed, run_dir));
}

void remove_earlier_run(const std::string& run_dir, const std::string& checkpoint_dir) {
  for (const std::string& file : earlier_run_files(run_dir, checkpoint_dir)) {
    std::error_code ec;
    fs::remove(file, ec);
    if (ec) throw IoError(fmt::format("--overwrite: cannot remove {}: {}", file, ec.message()));
  }
}

}  // namespace dtrain::checkpoint
