// The levels of the CPU backend's own loops (lanes.hpp) a test can run on this machine.
#pragma once

#include <doctest/doctest.h>

#include <vector>

#include "backends/onednn/context.hpp"

namespace dtrain::testing {

// Every level of the loops this CPU runs (4 lanes on plain x86-64, 8 on AVX2, 16 on AVX-512),
// narrowest first; one line for each it does not.
inline std::vector<backends::onednn::LoopIsa> loop_isas_here() {
  using backends::onednn::LoopIsa;
  std::vector<LoopIsa> isas;
  for (const LoopIsa isa : {LoopIsa::x86_64, LoopIsa::x86_64_v3, LoopIsa::x86_64_v4}) {
    if (static_cast<int>(isa) <= static_cast<int>(backends::onednn::widest_loop_isa())) {
      isas.push_back(isa);
    } else {
      MESSAGE("skipped: this CPU (oneDNN isa " << backends::onednn::effective_isa() << ") has no "
                                               << backends::onednn::name_of(isa) << " for the loops' build");
    }
  }
  return isas;
}

}  // namespace dtrain::testing
