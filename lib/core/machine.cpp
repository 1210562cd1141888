#include "core/machine.hpp"

#include <unistd.h>

#include <algorithm>
#include <limits>
#include <thread>

#include <fmt/format.h>

#include "core/checked.hpp"

namespace dtrain {

std::int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return std::numeric_limits<std::int64_t>::max();
  return checked_mul(pages, page).value_or(std::numeric_limits<std::int64_t>::max());
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
