#include "signals.hpp"

#include <poll.h>
#include <sys/prctl.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>

#include "core/atomic_file.hpp"
#include "core/error.hpp"

namespace dtrain::app {

namespace {

sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGUSR1);
  return set;
}

// Under OpenMPI's launcher (it sets OMPI_COMM_WORLD_SIZE in every rank): SIGTERM to this process
// when the launcher that started it dies, so a rank never trains on without its job.
void follow_launcher() {
  if (std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) return;
  const pid_t launcher = getppid();
  if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) return;  // only the orphan case is lost
  if (getppid() != launcher) kill(getpid(), SIGTERM);  // it died before the request took effect
}

// This process's checkpoint temporaries in `dir` ("<name>.tmp-<pid>"): what a save in flight leaves.
void remove_temporaries(const std::string& dir) {
  if (dir.empty()) return;
  const std::string suffix = ".tmp-" + std::to_string(static_cast<long>(getpid()));
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() > suffix.size() && name.ends_with(suffix)) {
      std::error_code ignored;
      std::filesystem::remove(it->path(), ignored);
    }
  }
}

bool same_directory(const std::string& a, const std::string& b) {
  std::error_code ec;
  return a == b || std::filesystem::equivalent(a, b, ec);
}

void say(const char* text, std::size_t size) {
  // write(2), not stdio: the second-signal path _exit()s right after, with nothing to flush.
  [[maybe_unused]] auto n = write(STDERR_FILENO, text, size);
}

}  // namespace

StopOnSignal::StopOnSignal() {
  const sigset_t set = stop_signals();
  // pthread_sigmask returns the error number instead of setting errno.
  if (const int err = pthread_sigmask(SIG_BLOCK, &set, &previous_mask_); err != 0)
    throw InternalError(std::string("cannot block SIGINT/SIGTERM: ") + std::strerror(err));
  signal_fd_ = signalfd(-1, &set, SFD_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (signal_fd_ < 0 || wake_fd_ < 0) {
    const int err = errno;
    close_fds();
    pthread_sigmask(SIG_SETMASK, &previous_mask_, nullptr);
    throw InternalError(std::string("cannot watch SIGINT/SIGTERM (signalfd/eventfd): ") + std::strerror(err));
  }
  follow_launcher();  // after the mask: the death signal lands in the signalfd like any other
  try {
    watcher_ = std::thread(&StopOnSignal::watch, this);  // inherits the blocked mask
  } catch (...) {
    close_fds();
    pthread_sigmask(SIG_SETMASK, &previous_mask_, nullptr);
    throw;
  }
}

StopOnSignal::~StopOnSignal() {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = write(wake_fd_, &one, sizeof one);
  watcher_.join();
  close_fds();
  // A signal that arrived after the watcher stopped (a second Ctrl-C while the stopped run shuts
  // down) is still pending; taken here, so that restoring the mask does not deliver it with its
  // default action and turn the run's exit code into a death by signal. The process is ending
  // anyway: what the signal asked for is happening.
  const sigset_t set = stop_signals();
  const timespec no_wait{0, 0};
  while (sigtimedwait(&set, nullptr, &no_wait) > 0) {
  }
  if (restore_mask_) pthread_sigmask(SIG_SETMASK, &previous_mask_, nullptr);
}

int StopOnSignal::finished(int exit_code) {
  finished_code_ = exit_code;
  return exit_code;
}

void StopOnSignal::set_directories(const std::string& run_dir, const std::string& checkpoint_dir) {
  const std::lock_guard lock(directories_mutex_);
  run_dir_ = run_dir;
  checkpoint_dir_ = checkpoint_dir;
}

void StopOnSignal::close_fds() noexcept {
  if (signal_fd_ >= 0) close(signal_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  signal_fd_ = wake_fd_ = -1;
}

void StopOnSignal::watch() {
  pollfd fds[2] = {{signal_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  for (;;) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;  // cannot happen with two valid fds; stopping only loses the graceful path
    }
    if (fds[1].revents != 0) return;  // the destructor
    if ((fds[0].revents & POLLIN) == 0) continue;
    signalfd_siginfo info;
    if (read(signal_fd_, &info, sizeof info) != static_cast<ssize_t>(sizeof info)) continue;
    const int sig = static_cast<int>(info.ssi_signo);
    if (const int code = finished_code_.load(); code >= 0) {
      // Nothing is left to save or to remove; what the command printed still reaches its reader.
      std::fflush(stdout);
      _exit(code);
    }
    if (stop_signal_.exchange(sig) != 0) {
      // Second signal: the user means it. No checkpoint, no destructors; only the temporary of a
      // save in flight goes, so that no half-written file is left behind.
      // The locks are held until _exit: a write in flight then blocks before it creates or
      // renames a temporary, so none appears after the removal.
      const std::lock_guard lock(directories_mutex_);
      using Names = TemporaryNamesLock;
      std::optional<Names> run_dir_names, checkpoint_dir_names;
      auto clear = [](std::optional<Names>& names, const std::string& dir) {
        if (dir.empty()) return;
        names.emplace(dir, Names::Mode::exclusive);
        remove_temporaries(dir);
      };
      clear(run_dir_names, run_dir_);
      // The same directory twice: a second flock would wait on the first.
      if (!same_directory(checkpoint_dir_, run_dir_)) clear(checkpoint_dir_names, checkpoint_dir_);
      constexpr char msg[] = "\ndtrain: second signal, exiting without a checkpoint\n";
      say(msg, sizeof msg - 1);
      _exit(128 + sig);
    }
    constexpr char msg[] =
        "\ndtrain: stopping after this step and saving a checkpoint (signal again to exit at once)\n";
    say(msg, sizeof msg - 1);
  }
}

}  // namespace dtrain::app
