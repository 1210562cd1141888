#include "train/run_dir.hpp"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "checkpoint/manager.hpp"
#include "core/error.hpp"

namespace dtrain::train {

namespace fs = std::filesystem;

std::string checkpoint_dir_of(const std::string& run_dir, const config::CheckpointConfig& checkpoint) {
  if (!checkpoint.dir.empty()) return checkpoint.dir;
  return run_dir.empty() ? std::string() : (fs::path(run_dir) / "checkpoints").string();
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

int free_run_number(const std::string& base) {
  if (earlier_run_files(base, (fs::path(base) / "checkpoints").string()).empty()) return 0;
  for (int n = 2;; ++n) {
    const std::string candidate = numbered_run_dir(base, n);
    if (earlier_run_files(candidate, (fs::path(candidate) / "checkpoints").string()).empty()) return n;
  }
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

}  // namespace dtrain::train
