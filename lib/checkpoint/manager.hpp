// CheckpointManager: numbered checkpoints in one directory, the newest max_to_keep of them kept
// (tf.train.CheckpointManager's semantics).
//
// A small text manifest named `checkpoint` in the directory lists the complete checkpoints, one
// file name per line, oldest first; it is replaced atomically after each save. A file the manifest
// does not list (a temporary left by a killed process, a ckpt written but not yet recorded) is not
// returned while the manifest is usable. The manifest is a hint, not the truth: its entries are
// taken once each, ordered by the step in their names (ckpt-<global step>.h5), and when it is
// missing, empty, garbage or lists no existing file, the ckpt-<step>.h5 regular files in the
// directory are used instead, with a warning (each file carries its own whole-file checksum, so a
// listed-or-not file is verified when it is read anyway).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.hpp"

namespace dtrain::checkpoint {

inline constexpr const char* kManifestName = "checkpoint";

class CheckpointManager {
 public:
  // Creates the directory (IoError when it cannot or cannot write into it) and removes stale
  // *.tmp-<pid> files in it.
  // max_to_keep must be >= 1 (ConfigError).
  CheckpointManager(std::string directory, int max_to_keep);

  // Writes <directory>/ckpt-<global_step>.h5 with checkpoint::save, records it in the manifest,
  // then deletes the oldest beyond max_to_keep, never one with a step above global_step. Returns
  // the new checkpoint's path.
  std::string save(std::int64_t global_step, const nn::Sequential& model, const optim::Optimizer& optimizer,
                   const Contents& contents);

  // Paths of the complete checkpoints, oldest first, from the manifest.
  std::vector<std::string> checkpoints() const;
  std::optional<std::string> latest() const;
  const std::string& directory() const { return directory_; }
  int max_to_keep() const { return max_to_keep_; }

 private:
  std::string directory_;
  int max_to_keep_;
};

// The complete checkpoints of `directory`, oldest first (by step), as paths: the manifest's existing
// entries, or the directory's ckpt-<step>.h5 files when the manifest is not usable; then
// `warning` (when given) says why, else it is set empty.
std::vector<std::string> list_checkpoints(const std::string& directory, std::string* warning = nullptr);

}  // namespace dtrain::checkpoint
