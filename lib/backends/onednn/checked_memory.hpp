// The CPU backend's checked mode (DTRAIN_CHECKED_MEMORY=1): its memory behaves as a GPU's does for
// the host. Every buffer the context allocates is a mapping of its own pages, kept PROT_NONE
// except while a call of the backend runs (Context::Call: a kernel, a copy, a numerics loop), so
// host code that reads or writes it outside the seam's copies faults at the access, and the
// context says host_accessible() == false so that callers take the staging paths a GPU needs. The
// numerics also refuse pointers that are not the context's memory (a label array the host forgot
// to stage), as a GPU kernel would fault on them.
//
// A test mode: each call costs an mprotect per buffer.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "device/context.hpp"

namespace dtrain::backends::onednn {

class CheckedMemory {
 public:

  // Zero-filled pages, inaccessible outside a call.
  device::Buffer allocate(std::size_t bytes);
  // A call of the backend begins / ends (nested and concurrent calls counted).
  void enter();
  void leave();
  // Whether [p, p + bytes) lies inside one buffer of this memory.
  bool owns(const void* p, std::size_t bytes) const;

  // Whether the checked mode is asked for (DTRAIN_CHECKED_MEMORY=1), read once per context.
  static bool requested();

 private:
  // Shared with the buffers' deleters: a tensor may outlive the context that made it.
  struct State {
    std::mutex mutex;
    std::map<const char*, std::size_t> buffers;  // start -> mapped bytes (page multiples)
    int depth = 0;                               // calls running
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// Numerics that run inside a call and check that their device pointers are the context's memory.
std::unique_ptr<device::Numerics> checked_numerics(device::Numerics& inner, CheckedMemory& memory,
                                                   device::Context& ctx);

}  // namespace dtrain::backends::onednn
