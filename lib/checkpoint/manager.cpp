#include "checkpoint/manager.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::checkpoint {
namespace {

namespace fs = std::filesystem;

// What save() and write_file_atomically() leave behind when the process dies mid-write:
// "<name>.tmp-<pid>".
bool is_stale_temporary(const std::string& name) {
  const std::size_t at = name.rfind(".tmp-");
  if (at == std::string::npos || at + 5 == name.size()) return false;
  return std::all_of(name.begin() + static_cast<std::ptrdiff_t>(at + 5), name.end(),
                     [](unsigned char c) { return std::isdigit(c) != 0; });
}

// The manifest's file names, oldest first, without checking that the files exist.
std::vector<std::string> read_manifest(const fs::path& directory) {
  const fs::path manifest = directory / kManifestName;
  std::error_code ec;
  if (!fs::exists(manifest, ec)) return {};
  std::ifstream in(manifest);
  if (!in)
    throw InputError(fmt::format("{}: cannot read the checkpoint manifest; check its permissions", manifest.string()));
  std::vector<std::string> names;
  std::string line;
  for (int line_number = 1; std::getline(in, line); ++line_number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (line.find('/') != std::string::npos || line == "." || line == "..")
      throw InputError(fmt::format("{}:{}: '{}' is not a file name in this directory; the manifest lists one "
                                   "checkpoint file name per line: fix or delete that line",
                                   manifest.string(), line_number, line));
    names.push_back(line);
  }
  if (in.bad())
    throw InputError(fmt::format("{}: reading the checkpoint manifest failed", manifest.string()));
  return names;
}

std::vector<std::string> existing(const fs::path& directory, const std::vector<std::string>& names) {
  std::vector<std::string> kept;
  for (const std::string& name : names) {
    std::error_code ec;
    if (fs::is_regular_file(directory / name, ec)) kept.push_back(name);
  }
  return kept;
}

}  // namespace

CheckpointManager::CheckpointManager(std::string directory, int max_to_keep)
    : directory_(std::move(directory)), max_to_keep_(max_to_keep) {
  if (max_to_keep_ < 1)
    throw ConfigError(fmt::format("checkpoint.max_to_keep is {}; it must be at least 1", max_to_keep_));
  std::error_code ec;
  fs::create_directories(directory_, ec);
  if (ec || !fs::is_directory(directory_, ec))
    throw IoError(fmt::format("{}: cannot create the checkpoint directory ({}); check the path and its permissions",
                              directory_, ec ? ec.message() : "not a directory"));
  // Only the chief writes here, and only through this manager, so a temporary found now belongs to
  // a process that died while writing it.
  for (fs::directory_iterator it(directory_, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code is_file_ec;
    if (it->is_regular_file(is_file_ec) && is_stale_temporary(it->path().filename().string())) {
      std::error_code ignored;
      fs::remove(it->path(), ignored);
    }
  }
  if (ec)
    throw IoError(fmt::format("{}: cannot list the checkpoint directory ({})", directory_, ec.message()));
}

std::string CheckpointManager::save(std::int64_t global_step, const nn::Sequential& model,
                                    const optim::Optimizer& optimizer, const Contents& contents) {
  DTRAIN_CHECK(global_step >= 0, fmt::format("checkpoint global step must be >= 0, got {}", global_step));
  const fs::path dir(directory_);
  const std::string name = fmt::format("ckpt-{}.h5", global_step);
  const std::string path = (dir / name).string();
  checkpoint::save(path, model, optimizer, contents);

  std::vector<std::string> names = existing(dir, read_manifest(dir));
  std::erase(names, name);  // saving the same step again makes it the newest
  names.push_back(name);
  const std::size_t keep = static_cast<std::size_t>(max_to_keep_);
  const std::size_t drop = names.size() > keep ? names.size() - keep : 0;
  const std::vector<std::string> doomed(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(drop));
  names.erase(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(drop));

  // The manifest changes before any file is deleted: a crash in between leaves an unlisted file
  // (ignored) rather than a listed one that is gone.
  std::string text;
  for (const std::string& n : names) text += n + "\n";
  write_file_atomically((dir / kManifestName).string(), text);
  for (const std::string& n : doomed) {
    // A file that cannot be deleted is no longer a checkpoint; it only costs disk space.
    std::error_code ignored;
    fs::remove(dir / n, ignored);
  }
  return path;
}

std::vector<std::string> CheckpointManager::checkpoints() const { return list_checkpoints(directory_); }

std::optional<std::string> CheckpointManager::latest() const {
  std::vector<std::string> all = checkpoints();
  if (all.empty()) return std::nullopt;
  return all.back();
}

std::vector<std::string> list_checkpoints(const std::string& directory) {
  const fs::path dir(directory);
  std::vector<std::string> paths;
  for (const std::string& name : existing(dir, read_manifest(dir))) paths.push_back((dir / name).string());
  return paths;
}

}  // namespace dtrain::checkpoint
