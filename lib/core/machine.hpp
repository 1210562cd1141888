// What this machine can hold, for checking sizes and thread counts from the experiment before
// anything is allocated or started (docs/experiment.md's "Limits" section documents the rules).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dtrain {

// The memory this process may use, and what sets it: the least of the machine's physical memory
// (sysconf), the memory limit of its cgroup (v1 memory.limit_in_bytes or v2 memory.max, its own
// and every level above it: what a container or a batch scheduler grants) and its address-space
// and data limits (ulimit -v, -d). A very large value when nothing says.
struct MemoryLimit {
  enum class Source : std::uint8_t { machine, cgroup, address_space, data_segment };
  std::int64_t bytes = 0;
  Source source = Source::machine;
};
MemoryLimit usable_memory();
// For messages: "this machine's 23.5 GB of memory", "the 2.0 GB memory limit of this process's
// cgroup", "the 2.0 GB address-space limit of this process (ulimit -v)".
std::string describe(const MemoryLimit& limit);

// The cgroup memory limit that /proc/self/cgroup's `self_cgroup` text names under the cgroup
// file systems mounted at `v1_root` (the memory controller's mount) and `v2_root`: the least over
// the process's own cgroup and its ancestors; nullopt when none sets one. Separate for the tests.
std::optional<std::int64_t> cgroup_memory_limit(const std::string& self_cgroup, const std::string& v1_root,
                                                const std::string& v2_root);

// The most compute threads an experiment may ask for: 4 per hardware thread, at least 64.
// Far more threads than cores only slow training down, and tens of thousands exhaust the
// stacks OpenMP gives each thread.
int max_compute_threads();

// "3.1 GB" and the like, for messages.
std::string format_bytes(std::int64_t bytes);

}  // namespace dtrain
