// StopOnSignal (apps/dtrain/signals.hpp): SIGINT/SIGTERM reach its watcher thread through a
// signalfd and never interrupt a compute thread.
//
// Tests that send a signal do it in a fork()ed child: kill() hands a process-directed signal to
// any thread that does not block it, and this test process may already hold threads created
// before any StopOnSignal (an OpenMP pool from an earlier test), whose default action would end
// the whole test run. The child has only the thread that forked.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/atomic_file.hpp"
#include "signals.hpp"

using dtrain::app::StopOnSignal;
using namespace std::chrono_literals;

namespace {

bool blocked_in_this_thread(int sig) {
  sigset_t now;
  pthread_sigmask(SIG_BLOCK, nullptr, &now);
  return sigismember(&now, sig) == 1;
}

// Generous limits: a loaded machine may leave the watcher thread unscheduled for seconds, and the
// limits only bound a failure, they never delay a success.
bool wait_for(const std::atomic<int>& flag, int want, std::chrono::milliseconds limit = 60000ms) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (flag.load() != want) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

struct ChildResult {
  int status = -1;  // waitpid's status; -1 if the child had to be killed after the time limit
  std::string err;  // what it wrote to stderr
};

// Runs `body` in a fork()ed child and returns how it ended. The child exits with body's result.
ChildResult in_child(const std::function<int()>& body) {
  int err_pipe[2];
  REQUIRE(pipe(err_pipe) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(err_pipe[0]);
    dup2(err_pipe[1], STDERR_FILENO);
    _exit(body());  // _exit: the child must not run the parent's doctest teardown
  }
  close(err_pipe[1]);
  fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);
  ChildResult result;
  char buffer[512];
  const auto until = std::chrono::steady_clock::now() + 180s;
  int status = 0;
  for (;;) {
    for (ssize_t n; (n = read(err_pipe[0], buffer, sizeof buffer)) > 0;) result.err.append(buffer, static_cast<std::size_t>(n));
    if (waitpid(pid, &status, WNOHANG) == pid) {
      result.status = status;
      break;
    }
    if (std::chrono::steady_clock::now() > until) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(2ms);
  }
  for (ssize_t n; (n = read(err_pipe[0], buffer, sizeof buffer)) > 0;) result.err.append(buffer, static_cast<std::size_t>(n));
  close(err_pipe[0]);
  return result;
}

bool exited_with(const ChildResult& r, int code) {
  return r.status != -1 && WIFEXITED(r.status) && WEXITSTATUS(r.status) == code;
}

}  // namespace

TEST_CASE("StopOnSignal blocks SIGINT/SIGTERM in threads started after it and restores the mask") {
  // Whatever the caller blocked before stays blocked afterwards; only what StopOnSignal added goes.
  sigset_t only_int;
  sigemptyset(&only_int);
  sigaddset(&only_int, SIGINT);
  sigset_t before;
  REQUIRE(pthread_sigmask(SIG_BLOCK, &only_int, &before) == 0);
  const bool term_was_blocked = sigismember(&before, SIGTERM) == 1;
  {
    StopOnSignal signals;
    CHECK(signals.requested().load() == 0);
    CHECK(blocked_in_this_thread(SIGINT));
    CHECK(blocked_in_this_thread(SIGTERM));
    bool int_blocked = false, term_blocked = false;
    std::thread compute([&] {
      int_blocked = blocked_in_this_thread(SIGINT);
      term_blocked = blocked_in_this_thread(SIGTERM);
    });
    compute.join();
    CHECK(int_blocked);
    CHECK(term_blocked);
  }
  CHECK(blocked_in_this_thread(SIGINT));
  CHECK(blocked_in_this_thread(SIGTERM) == term_was_blocked);
  pthread_sigmask(SIG_SETMASK, &before, nullptr);

  // Construction and destruction do not hang or leak: the destructor wakes the watcher.
  for (int i = 0; i < 50; ++i) {
    StopOnSignal signals;
    CHECK(signals.requested().load() == 0);
  }
  CHECK(blocked_in_this_thread(SIGTERM) == term_was_blocked);
}

TEST_CASE("a signal to the process sets requested() while a compute thread runs") {
  for (int sig : {SIGTERM, SIGINT}) {
    CAPTURE(sig);
    const ChildResult r = in_child([sig] {
      StopOnSignal signals;
      std::atomic<bool> done{false};
      std::thread compute([&] {
        volatile double x = 1;
        while (!done.load()) x = x * 1.0000001;
      });
      kill(getpid(), sig);
      const bool seen = wait_for(signals.requested(), sig);
      done = true;
      compute.join();
      // Had the signal reached the compute thread, its default action would have ended the
      // process (status: killed by the signal) instead.
      return seen ? 0 : 10;
    });
    CHECK_MESSAGE(exited_with(r, 0), "status ", r.status, ", stderr: ", r.err);
    CHECK(r.err.find("stopping after this step and saving a checkpoint") != std::string::npos);
  }
}

TEST_CASE("a second signal exits at once with 128 + the signal") {
  for (int sig : {SIGINT, SIGTERM}) {
    CAPTURE(sig);
    const ChildResult r = in_child([sig] {
      StopOnSignal signals;
      kill(getpid(), sig);
      if (!wait_for(signals.requested(), sig)) return 10;
      kill(getpid(), sig);
      std::this_thread::sleep_for(120s);
      return 11;  // the watcher should have ended the process by now
    });
    CHECK_MESSAGE(exited_with(r, 128 + sig), "status ", r.status, ", stderr: ", r.err);
    CHECK(r.err.find("second signal, exiting without a checkpoint") != std::string::npos);
  }
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST_CASE("SIGUSR1 (what mpirun forwards) asks for a stop; a second signal removes this process's temporaries") {
  const std::string run_dir =
      (std::filesystem::temp_directory_path() / ("dtrain_test_signals_" + std::to_string(getpid()))).string();
  const std::string dir = run_dir + "/checkpoints";
  std::filesystem::remove_all(run_dir);
  std::filesystem::create_directories(dir);
  const ChildResult r = in_child([&] {
    StopOnSignal signals;
    signals.set_directories(run_dir, dir);
    // Saves in flight in this process, and another process's temporary (not ours to remove).
    std::ofstream(dir + "/ckpt-5.h5.tmp-" + std::to_string(getpid())) << "partial";
    std::ofstream(run_dir + "/metrics.jsonl.tmp-" + std::to_string(getpid())) << "partial";
    std::ofstream(dir + "/ckpt-3.h5.tmp-1") << "someone else's";
    kill(getpid(), SIGUSR1);
    if (!wait_for(signals.requested(), SIGUSR1)) return 10;
    kill(getpid(), SIGUSR1);
    std::this_thread::sleep_for(120s);
    return 11;
  });
  CHECK_MESSAGE(exited_with(r, 128 + SIGUSR1), "status ", r.status, ", stderr: ", r.err);
  CHECK(names_in(dir) == std::vector<std::string>{"ckpt-3.h5.tmp-1"});
  CHECK(names_in(run_dir) == std::vector<std::string>{"checkpoints"});
  std::filesystem::remove_all(run_dir);
}

TEST_CASE("a second signal during back-to-back atomic writes leaves no temporary behind") {
  // Writers create and rename temporaries as fast as they can, in the run directory and in the
  // checkpoint directory, while the second signal arrives: without the directories' locks a
  // temporary created after the watcher's removal was left behind.
  const std::string run_dir =
      (std::filesystem::temp_directory_path() / ("dtrain_test_signals_race_" + std::to_string(getpid()))).string();
  const std::string dir = run_dir + "/checkpoints";
  for (int round = 0; round < 20; ++round) {
    std::filesystem::remove_all(run_dir);
    std::filesystem::create_directories(dir);
    const ChildResult r = in_child([&] {
      StopOnSignal signals;
      signals.set_directories(run_dir, dir);
      const std::string text(4096, 'x');
      auto keep_writing = [&text](const std::string& path) {
        for (;;) dtrain::write_file_atomically(path, text);
      };
      std::thread(keep_writing, dir + "/checkpoint").detach();
      std::thread(keep_writing, run_dir + "/metrics.jsonl").detach();
      // Both writers have finished a write (on a loaded machine they may not have been scheduled
      // yet), so each file must be there, whole, whenever the signal lands.
      for (int waited_ms = 0; !(std::filesystem::exists(dir + "/checkpoint") &&
                                std::filesystem::exists(run_dir + "/metrics.jsonl"));
           ++waited_ms) {
        if (waited_ms > 30000) return 12;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5 + round));
      kill(getpid(), SIGTERM);
      if (!wait_for(signals.requested(), SIGTERM)) return 10;
      std::this_thread::sleep_for(std::chrono::microseconds(round * 100));
      kill(getpid(), SIGTERM);
      std::this_thread::sleep_for(120s);
      return 11;
    });
    REQUIRE_MESSAGE(exited_with(r, 128 + SIGTERM), "round ", round, ": status ", r.status, ", stderr: ", r.err);
    CHECK_MESSAGE(names_in(dir) == std::vector<std::string>{"checkpoint"}, "round ", round);
    CHECK_MESSAGE(names_in(run_dir) == (std::vector<std::string>{"checkpoints", "metrics.jsonl"}), "round ", round);
  }
  std::filesystem::remove_all(run_dir);
}
