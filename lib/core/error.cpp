#include "core/error.hpp"

#include <fmt/format.h>

namespace dtrain {

void throw_internal(const char* expr, const char* file, int line, const std::string& detail) {
  throw InternalError(fmt::format("internal error: check '{}' failed at {}:{}{}{} (please report this)", expr,
                                  file, line, detail.empty() ? "" : ": ", detail));
}

}  // namespace dtrain
