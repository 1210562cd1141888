#include "checkpoint/manager.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "core/atomic_file.hpp"
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

// The step in a checkpoint's name, ckpt-<global step>.h5; nullopt for any other name.
std::optional<std::int64_t> step_of(const std::string& name) {
  constexpr std::string_view prefix = "ckpt-", suffix = ".h5";
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) || !name.ends_with(suffix))
    return std::nullopt;
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c) != 0; }))
    return std::nullopt;
  return std::stoll(digits);
}

// What stands at `path` instead of a regular file, for a warning: "a FIFO", "a symbolic link to
// nothing", ...
std::string what_is_at(const fs::path& path) {
  std::error_code ec;
  const fs::file_status target = fs::status(path, ec);
  const std::string what = !fs::exists(target)         ? "nothing"
                           : fs::is_directory(target)  ? "a directory"
                           : fs::is_fifo(target)       ? "a FIFO"
                           : fs::is_socket(target)     ? "a socket"
                           : fs::is_block_file(target) || fs::is_character_file(target) ? "a device"
                                                       : "not a regular file";
  return fs::is_symlink(fs::symlink_status(path, ec)) ? "a symbolic link to " + what : what;
}

// Regular files only (or links to one): a FIFO or device named like a checkpoint would block or
// lie when read. Anything else there by that name is never opened, and said in `skipped`: a
// checkpoint the run wrote is gone, and resume goes back to an older one.
bool is_checkpoint_file(const fs::path& path, std::vector<std::string>& skipped) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return true;
  if (fs::exists(fs::symlink_status(path, ec))) {
    std::string note = fmt::format("{} is {}, not a checkpoint file: skipped", path.string(), what_is_at(path));
    if (std::find(skipped.begin(), skipped.end(), note) == skipped.end()) skipped.push_back(std::move(note));
  }
  return false;
}

// Each name once, ordered by the step in it (oldest first): the manifest's order is not trusted,
// since a manifest edited or written out of order must never make an older file look newest.
std::vector<std::string> ordered(std::vector<std::string> names) {
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
    return std::pair(*step_of(a), a) < std::pair(*step_of(b), b);  // equal names end up next to each other
  });
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

// The checkpoint files in the directory itself, oldest first.
std::vector<std::string> scan(const fs::path& directory, std::vector<std::string>& skipped) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(directory, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (step_of(name) && is_checkpoint_file(it->path(), skipped)) names.push_back(name);
  }
  return ordered(std::move(names));
}

// complete_checkpoints without the skipped files in its warning.
std::vector<std::string> listed_or_scanned(const fs::path& directory, std::string& warning,
                                           std::vector<std::string>& skipped) {
  const fs::path manifest = directory / kManifestName;
  std::error_code ec;
  const fs::file_status status = fs::status(manifest, ec);
  const auto fall_back = [&](const std::string& why) {
    skipped.clear();  // the scan finds them again
    std::vector<std::string> found = scan(directory, skipped);
    if (!found.empty())
      warning = fmt::format("{}: {}; using the {} checkpoint file{} found in {} instead", manifest.string(), why,
                            found.size(), found.size() == 1 ? "" : "s", directory.string());
    return found;
  };
  if (!fs::exists(status)) return fall_back("missing");
  if (!fs::is_regular_file(status)) return fall_back("not a regular file");
  std::ifstream in(manifest);
  if (!in) return fall_back("cannot be read");
  std::vector<std::string> names;
  std::string line;
  for (int line_number = 1; std::getline(in, line); ++line_number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (!step_of(line) || line.find('/') != std::string::npos)
      return fall_back(fmt::format("line {} is not a checkpoint file name (ckpt-<step>.h5)", line_number));
    if (is_checkpoint_file(directory / line, skipped)) names.push_back(line);
  }
  if (in.bad()) return fall_back("reading it failed");
  if (names.empty()) return fall_back("lists no existing checkpoint");
  return ordered(std::move(names));
}

// The complete checkpoints, oldest first: those the manifest lists that exist, each once, ordered
// by step. When the manifest is missing, unreadable, a special file, holds a line that is not a
// checkpoint name or lists no existing file while checkpoint files are there, the directory is
// scanned instead and `warning` says why; it also names what stands in place of a checkpoint
// (a FIFO, a link to nothing), which is skipped.
std::vector<std::string> complete_checkpoints(const fs::path& directory, std::string& warning) {
  std::vector<std::string> skipped;
  std::vector<std::string> found = listed_or_scanned(directory, warning, skipped);
  for (const std::string& note : skipped) warning += (warning.empty() ? "" : "; ") + note;
  return found;
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
  // A directory where the manifest goes could never be replaced by it: found now, not at a save.
  const fs::path manifest = fs::path(directory_) / kManifestName;
  if (fs::is_directory(fs::symlink_status(manifest, ec)))
    throw IoError(fmt::format("{}: is a directory, where the checkpoint manifest goes; remove or rename it",
                              manifest.string()));
  // Writable now, not found out at the first save an epoch later. Permissions alone do not tell
  // (root ignores them, a read-only mount does not show in them): a file is created and removed.
  // Its name is a temporary's, so one left by a killed process is removed like the others.
  const std::string probe = (fs::path(directory_) / fmt::format(".write-probe.tmp-{}", static_cast<long>(::getpid()))).string();
  const TemporaryNamesLock names(directory_, TemporaryNamesLock::Mode::shared);
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw IoError(fmt::format("{}: the checkpoint directory is not writable ({}); make it writable or set "
                              "checkpoint.dir to another directory",
                              directory_, std::strerror(errno)));
  ::close(fd);
  fs::remove(probe, ec);
}

std::string CheckpointManager::save(std::int64_t global_step, const nn::Sequential& model,
                                    const optim::Optimizer& optimizer, const Contents& contents) {
  DTRAIN_CHECK(global_step >= 0, fmt::format("checkpoint global step must be >= 0, got {}", global_step));
  const fs::path dir(directory_);
  const std::string name = fmt::format("ckpt-{}.h5", global_step);
  const std::string path = (dir / name).string();
  checkpoint::save(path, model, optimizer, contents);

  std::string ignored_warning;  // the manifest is rewritten from what is found: nothing to warn about
  std::vector<std::string> names = complete_checkpoints(dir, ignored_warning);
  names.push_back(name);
  names = ordered(std::move(names));
  // The newest max_to_keep by step are kept, and never a file newer than the one just written (a
  // run resumed from an older checkpoint must not delete what came after it) nor that file itself.
  const std::size_t keep = static_cast<std::size_t>(max_to_keep_);
  std::vector<std::string> doomed;
  for (std::size_t i = 0; i + keep < names.size(); ++i)
    if (*step_of(names[i]) < global_step) doomed.push_back(names[i]);
  std::erase_if(names, [&](const std::string& n) { return std::find(doomed.begin(), doomed.end(), n) != doomed.end(); });

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

std::vector<std::string> list_checkpoints(const std::string& directory, std::string* warning) {
  const fs::path dir(directory);
  std::string why;
  std::vector<std::string> paths;
  for (const std::string& name : complete_checkpoints(dir, why)) paths.push_back((dir / name).string());
  if (warning) *warning = why;
  return paths;
}

}  // namespace dtrain::checkpoint
