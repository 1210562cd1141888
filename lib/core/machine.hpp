// What this machine can hold, for checking sizes and thread counts from the experiment before
// anything is allocated or started (docs/experiment.md's "Limits" section documents the rules).
#pragma once

#include <cstdint>
#include <string>

namespace dtrain {

// Physical memory in bytes (sysconf); a very large value when the system does not say.
std::int64_t physical_memory_bytes();

// The most compute threads an experiment may ask for: 4 per hardware thread, at least 64.
// Far more threads than cores only slow training down, and tens of thousands exhaust the
// stacks OpenMP gives each thread.
int max_compute_threads();

// "3.1 GB" and the like, for messages.
std::string format_bytes(std::int64_t bytes);

}  // namespace dtrain
