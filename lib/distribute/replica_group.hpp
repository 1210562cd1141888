// The collectives among the local replicas of one process: one Communicator endpoint per replica,
// and the barrier the replicas' threads meet at. A strategy holds its group through this interface
// alone, so the group over host memory (ThreadGroup, thread_group.hpp) and a group over devices
// (NCCL's) are interchangeable: a new kind is one file implementing this and a case in
// make_replica_group.
#pragma once

#include <memory>
#include <string>

#include "distribute/barrier.hpp"
#include "distribute/communicator.hpp"

namespace dtrain::distribute {

enum class CrossDeviceOp { reduction_to_one_device, hierarchical_copy, ring };
const char* name_of(CrossDeviceOp op);
// "reduction_to_one_device", "hierarchical_copy" or "ring"; anything else is an InternalError (the
// strategy resolves "auto" and refuses "nccl" on CPU before this).
CrossDeviceOp cross_device_op_named(const std::string& name);


class ReplicaGroup {
 public:
  virtual ~ReplicaGroup() = default;
  virtual int size() const = 0;
  // The cross-device op the group's float sums run on ("ring", "hierarchical_copy", ...).
  virtual const char* name() const = 0;
  // Replica r's endpoint, called only from replica r's thread; InternalError outside [0, size()).
  virtual Communicator& endpoint(int replica) = 0;
  // The barrier the replicas meet at; the strategy breaks it when a replica fails.
  virtual Barrier& barrier() = 0;
};

// The group of `size` local replicas whose sums run on `op`.
std::unique_ptr<ReplicaGroup> make_replica_group(int size, CrossDeviceOp op);

}  // namespace dtrain::distribute
