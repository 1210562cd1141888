#include "signals.hpp"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/error.hpp"

namespace dtrain::app {

namespace {

sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
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
  // A signal that arrived after the watcher stopped is still pending and is delivered here with
  // the previous disposition, as if this object had never existed.
  pthread_sigmask(SIG_SETMASK, &previous_mask_, nullptr);
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
    if (stop_signal_.exchange(sig) != 0) {
      // Second signal: the user means it. No checkpoint, no destructors.
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
