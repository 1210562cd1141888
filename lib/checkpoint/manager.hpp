// CheckpointManager: numbered checkpoints in one directory, the newest max_to_keep of them kept
// (tf.train.CheckpointManager's semantics).
//
// A small text manifest named `checkpoint` in the directory lists the complete checkpoints, one
// file name per line, oldest first; it is replaced atomically after each save. A file the manifest
// does not list (a temporary left by a killed process, a ckpt written but not yet recorded) is not
// a complete checkpoint and is never returned.
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
  // Creates the directory (IoError when it cannot) and removes stale *.tmp-* files in it.
  // max_to_keep must be >= 1 (ConfigError).
  CheckpointManager(std::string directory, int max_to_keep);

  // Writes <directory>/ckpt-<global_step>.h5 with checkpoint::save, records it in the manifest,
  // then deletes the oldest beyond max_to_keep. Returns the new checkpoint's path.
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

// The complete checkpoints recorded in `directory`'s manifest, oldest first, as paths; empty when
// there is no manifest. Entries whose file has disappeared are left out. InputError when the
// manifest is unreadable or names something other than a file in the directory.
std::vector<std::string> list_checkpoints(const std::string& directory);

}  // namespace dtrain::checkpoint
