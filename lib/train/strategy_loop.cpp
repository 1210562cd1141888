#include "train/strategy_loop.hpp"

#include <map>
#include <string>

#include <fmt/format.h>

namespace dtrain::train {

namespace {

// Filled by the loops' registrations before main, read-only afterwards.
std::map<std::string, StrategyLoopFactory, std::less<>>& loops() {
  static std::map<std::string, StrategyLoopFactory, std::less<>> registered;
  return registered;
}

}  // namespace

StrategyLoopRegistration::StrategyLoopRegistration(std::string_view kind, StrategyLoopFactory factory) {
  DTRAIN_CHECK(factory != nullptr, fmt::format("the loop of strategy kind '{}' needs a factory", kind));
  DTRAIN_CHECK(loops().emplace(std::string(kind), factory).second,
               fmt::format("strategy kind '{}' registers its loop twice", kind));
}

std::unique_ptr<StrategyLoop> make_strategy_loop(std::string_view kind, distribute::Strategy& strategy) {
  const auto found = loops().find(kind);
  if (found == loops().end())
    throw InternalError(fmt::format("strategy kind '{}' schedules its own steps but registered no loop", kind));
  return found->second(strategy);
}

}  // namespace dtrain::train
