// The collectives among the local replicas of one process: one Communicator endpoint per replica,
// and the barrier the replicas' threads meet at. A strategy holds its group through this interface
// alone, so the group over host memory (ThreadGroup, thread_group.hpp) and a group over devices
// (NCCL's) are interchangeable: a new kind is one file implementing this and a case in
// make_replica_group.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"

#include "distribute/barrier.hpp"
#include "distribute/communicator.hpp"

namespace dtrain::distribute {

// The first three sum in host memory (ThreadGroup); nccl sums the GPUs' memory (NcclGroup,
// nccl_communicator.hpp).
enum class CrossDeviceOp { reduction_to_one_device, hierarchical_copy, ring, nccl };
const char* name_of(CrossDeviceOp op);
// "reduction_to_one_device", "hierarchical_copy", "ring" or "nccl"; anything else is an
// InternalError (the strategy resolves "auto" before this).
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
  // A replica failed in a step, and its threads have stopped: cancels the device sums the others
  // queued for it (Communicator::abandon_device_sums); a later sum starts the group afresh.
  virtual void abandon_device_sums() {}
};

// The group of `size` local replicas whose sums run on `op`, one of the host-memory ops.
std::unique_ptr<ReplicaGroup> make_replica_group(int size, CrossDeviceOp op);
// The same for the replicas on `devices`: nccl (GPU devices, a build with NCCL: the strategy says
// so to the user first, here it is an InternalError) or a host-memory op.
std::unique_ptr<ReplicaGroup> make_replica_group(const std::vector<Device>& devices, CrossDeviceOp op);

}  // namespace dtrain::distribute
