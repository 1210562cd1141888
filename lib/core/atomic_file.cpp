#include "core/atomic_file.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void throw_errno(const std::string& path, const std::string& what) {
  throw IoError(fmt::format("{}: {} failed ({}); check the disk and the directory's permissions", path, what,
                            std::strerror(errno)));
}

}  // namespace

void sync_directory_of(const std::string& path) {
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_errno(path, fmt::format("opening directory {} to sync it", dir.string()));
  const int status = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  errno = saved;
  // Some file systems cannot sync a directory (EINVAL); the rename is then as durable as they allow.
  if (status != 0 && errno != EINVAL) throw_errno(path, fmt::format("fsync of directory {}", dir.string()));
}

TemporaryNamesLock::TemporaryNamesLock(const std::string& directory, Mode mode) {
  fd_ = ::open(directory.empty() ? "." : directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) return;
  int status;
  do {
    status = ::flock(fd_, mode == Mode::exclusive ? LOCK_EX : LOCK_SH);
  } while (status != 0 && errno == EINTR);
  if (status != 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

TemporaryNamesLock::~TemporaryNamesLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the lock
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string temporary = fmt::format("{}.tmp-{}", path, static_cast<long>(::getpid()));
  const std::string directory = fs::path(path).parent_path().string();
  using Names = TemporaryNamesLock;
  try {
    int fd;
    {
      const Names names(directory, Names::Mode::shared);
      fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    }
    if (fd < 0) throw_errno(path, fmt::format("creating {}", temporary));
    std::size_t written = 0;
    while (written < text.size()) {
      const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int saved = errno;
        ::close(fd);
        errno = saved;
        throw_errno(path, fmt::format("writing {}", temporary));
      }
      written += static_cast<std::size_t>(n);
    }
    const int synced = ::fsync(fd);
    const int saved = errno;
    if (::close(fd) != 0 || synced != 0) {
      errno = synced != 0 ? saved : errno;
      throw_errno(path, fmt::format("fsync of {}", temporary));
    }
    std::error_code ec;
    {
      const Names names(directory, Names::Mode::shared);
      fs::rename(temporary, path, ec);
    }
    if (ec)
      throw IoError(fmt::format("{}: cannot rename {} to it ({}); check the directory's permissions", path, temporary,
                                ec.message()));
    sync_directory_of(path);
  } catch (...) {
    const Names names(directory, Names::Mode::shared);
    std::error_code ignored;
    fs::remove(temporary, ignored);
    throw;
  }
}

}  // namespace dtrain
