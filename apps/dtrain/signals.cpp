#include "signals.hpp"

#include <csignal>
#include <unistd.h>

namespace dtrain::app {

namespace {

// A signal handler can only reach process-wide state; this flag is the one place dtrain keeps
// any, and only the handler writes it.
std::atomic<int> g_stop_signal{0};
struct sigaction g_previous_int, g_previous_term;

void on_signal(int sig) {
  if (g_stop_signal.exchange(sig) != 0) {
    // Second signal: the user means it. Async-signal-safe exit, no checkpoint.
    constexpr char msg[] = "\ndtrain: second signal, exiting without a checkpoint\n";
    [[maybe_unused]] auto n = write(STDERR_FILENO, msg, sizeof msg - 1);
    _exit(128 + sig);
  }
  constexpr char msg[] = "\ndtrain: stopping after this step and saving a checkpoint (signal again to exit at once)\n";
  [[maybe_unused]] auto n = write(STDERR_FILENO, msg, sizeof msg - 1);
}

}  // namespace

StopOnSignal::StopOnSignal() {
  g_stop_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;  // a signal must not make an interrupted read or write fail
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &g_previous_int);
  sigaction(SIGTERM, &sa, &g_previous_term);
}

StopOnSignal::~StopOnSignal() {
  sigaction(SIGINT, &g_previous_int, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
}

const std::atomic<int>& StopOnSignal::requested() const { return g_stop_signal; }

}  // namespace dtrain::app
