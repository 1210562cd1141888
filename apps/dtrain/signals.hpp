// SIGINT/SIGTERM during training: the first asks the trainer to stop at the next step boundary
// (it saves a checkpoint and says how to resume); a second exits at once.
#pragma once

#include <atomic>

namespace dtrain::app {

class StopOnSignal {
 public:
  StopOnSignal();   // installs the handlers
  ~StopOnSignal();  // restores the previous ones
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;
  // Non-zero (the signal number) once a stop was requested.
  const std::atomic<int>& requested() const;
};

}  // namespace dtrain::app
