// What many unit tests share: the CPU backend's context they compute on, and step contexts.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "backends/context.hpp"
#include "nn/step.hpp"

namespace dtrain::testing {

// The CPU backend's context (made once per test binary; the tests that use it run on one thread).
inline backends::Context& cpu() {
  static const std::unique_ptr<backends::Context> ctx = backends::make_context(Device{});
  return *ctx;
}
inline backends::Numerics& cpu_numerics() { return cpu().numerics(); }

// A training (or inference) step of one replica alone.
inline nn::StepContext step_of(nn::Mode mode, std::int64_t samples = 0) {
  nn::StepContext step;
  step.mode = mode;
  step.step_samples = samples;
  return step;
}

// A fresh directory under the system's temporary directory, removed with the object; `what`
// names the test in the directory's name.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& what) {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("dtrain_test_" + what + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace dtrain::testing
