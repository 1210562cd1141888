#include "core/machine.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "core/checked.hpp"

namespace dtrain {

namespace {

constexpr std::int64_t kUnlimited = std::numeric_limits<std::int64_t>::max();

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A limit file's value: a byte count, or "max" (v2) / a page-rounded near-2^63 value (v1) for none.
std::optional<std::int64_t> limit_in(const std::string& path) {
  const std::optional<std::string> text = read_text(path);
  if (!text) return std::nullopt;
  std::int64_t value = 0;
  const char* begin = text->data();
  const char* end = begin + text->size();
  while (begin < end && std::isspace(static_cast<unsigned char>(*begin))) ++begin;
  const auto [at, ec] = std::from_chars(begin, end, value);
  if (ec != std::errc() || at == begin || value <= 0 || value >= (kUnlimited / 2)) return std::nullopt;
  return value;
}

// The least limit in `file` over `dir` and its ancestors up to `root` (the mount point).
std::optional<std::int64_t> least_up_to_root(const std::string& root, std::string dir, const char* file) {
  std::optional<std::int64_t> least;
  for (;;) {
    if (const auto v = limit_in(root + dir + "/" + file); v && (!least || *v < *least)) least = v;
    if (dir.empty() || dir == "/") break;
    const std::size_t slash = dir.find_last_of('/');
    dir = slash == std::string::npos ? std::string() : dir.substr(0, slash);
  }
  return least;
}

std::optional<std::int64_t> rlimit(int resource) {
  rlimit64 r{};
  if (getrlimit64(resource, &r) != 0 || r.rlim_cur == RLIM64_INFINITY || r.rlim_cur >= static_cast<rlim64_t>(kUnlimited))
    return std::nullopt;
  return static_cast<std::int64_t>(r.rlim_cur);
}

}  // namespace

std::optional<std::int64_t> cgroup_memory_limit(const std::string& self_cgroup, const std::string& v1_root,
                                                const std::string& v2_root) {
  std::optional<std::int64_t> least;
  const auto take = [&](std::optional<std::int64_t> v) {
    if (v && (!least || *v < *least)) least = v;
  };
  std::istringstream lines(self_cgroup);
  for (std::string line; std::getline(lines, line);) {
    // "4:memory:/a/b" (v1; the controllers may be listed together, "4:cpu,memory:/a") or "0::/a" (v2).
    const std::size_t first = line.find(':'), second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    std::string path = line.substr(second + 1);
    if (!path.empty() && path.back() == '/') path.pop_back();
    if (controllers.empty()) {
      take(least_up_to_root(v2_root, path, "memory.max"));
      continue;
    }
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) {
      if (name != "memory") continue;
      // In a container without a cgroup namespace the path is the host's, and the mount holds
      // only the container's own level: its root is read too.
      take(least_up_to_root(v1_root, path, "memory.limit_in_bytes"));
      take(limit_in(v1_root + "/memory.limit_in_bytes"));
    }
  }
  return least;
}

namespace {

MemoryLimit read_usable_memory() {
  MemoryLimit limit{kUnlimited, MemoryLimit::Source::machine};
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) limit.bytes = checked_mul(pages, page).value_or(kUnlimited);
  const auto lower = [&](std::optional<std::int64_t> bytes, MemoryLimit::Source source) {
    if (bytes && *bytes < limit.bytes) limit = MemoryLimit{*bytes, source};
  };
  if (const auto self = read_text("/proc/self/cgroup"))
    lower(cgroup_memory_limit(*self, "/sys/fs/cgroup/memory", "/sys/fs/cgroup"), MemoryLimit::Source::cgroup);
  lower(rlimit(RLIMIT_AS), MemoryLimit::Source::address_space);
  lower(rlimit(RLIMIT_DATA), MemoryLimit::Source::data_segment);
  return limit;
}

}  // namespace

MemoryLimit usable_memory() {
  // Read once: every tensor's size is checked against it, and the limits do not change while a
  // run lasts.
  static const MemoryLimit limit = read_usable_memory();
  return limit;
}

std::string describe(const MemoryLimit& limit) {
  switch (limit.source) {
    case MemoryLimit::Source::cgroup:
      return fmt::format("the {} memory limit of this process's cgroup", format_bytes(limit.bytes));
    case MemoryLimit::Source::address_space:
      return fmt::format("the {} address-space limit of this process (ulimit -v)", format_bytes(limit.bytes));
    case MemoryLimit::Source::data_segment:
      return fmt::format("the {} data-segment limit of this process (ulimit -d)", format_bytes(limit.bytes));
    case MemoryLimit::Source::machine:
      break;
  }
  return fmt::format("this machine's {} of memory", format_bytes(limit.bytes));
}


int max_compute_threads() {
  const unsigned hardware = std::thread::hardware_concurrency();
  return static_cast<int>(std::max<unsigned>(64, 4 * std::min<unsigned>(hardware, 1u << 20)));
}

std::string format_bytes(std::int64_t bytes) {
  constexpr const char* units[] = {"bytes", "KB", "MB", "GB", "TB", "PB", "EB"};
  double value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(units)) {
    value /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} bytes", bytes) : fmt::format("{:.1f} {}", value, units[unit]);
}

}  // namespace dtrain
