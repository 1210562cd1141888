// Files that are replaced whole or not at all, and survive a crash once written: checkpoints,
// metrics.jsonl, the checkpoint manifest, the run directory's files. Every failure is an IoError
// naming `path`.
#pragma once

#include <string>

namespace dtrain {

// fsync of the directory holding `path`, so a rename into it survives a crash.
void sync_directory_of(const std::string& path);
// Replaces `path` by `text` as a checkpoint is replaced: temporary, fsync, rename, directory fsync.
// The temporary ("<path>.tmp-<pid>") is created, renamed and removed under a shared
// TemporaryNamesLock of its directory.
void write_file_atomically(const std::string& path, const std::string& text);

// An advisory lock (flock) on a directory that orders the appearance and disappearance of
// temporary names in it. Writers hold it shared only around creating, renaming or removing a
// temporary (not while writing it, so holders never wait on a slow disk for long); a process that
// must leave no temporary behind (a second stop signal, which exits at once) takes it exclusive,
// removes its temporaries and exits still holding it: no write in flight can then create a new one
// or rename one into place. Best effort: a directory that cannot be opened or locked (a file
// system without flock) is not locked.
class TemporaryNamesLock {
 public:
  enum class Mode { shared, exclusive };
  TemporaryNamesLock(const std::string& directory, Mode mode);
  ~TemporaryNamesLock();
  TemporaryNamesLock(const TemporaryNamesLock&) = delete;
  TemporaryNamesLock& operator=(const TemporaryNamesLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace dtrain
