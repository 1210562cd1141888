// MirroredStrategy: one replica per device, each on its own thread with its own copy of the
// variables; the gradients are all-reduced by the cross-device op and every copy applies the same
// update, so the copies stay bit-identical.
#pragma once

#include <string_view>

#include "config/experiment.hpp"

namespace dtrain::distribute {

// How the replicas sum values (tf.distribute.CrossDeviceOps).
enum class CrossDeviceOpsKind {
  auto_select,              // "auto": let the strategy pick for the devices it has
  reduction_to_one_device,  // gather on one device, reduce there, broadcast back
  hierarchical_copy,        // tf.distribute.HierarchicalCopyAllReduce
  ring,                     // ring all-reduce
  nccl,                     // tf.distribute.NcclAllReduce
};
const char* name_of(CrossDeviceOpsKind kind);

struct MirroredOptions {
  static constexpr std::string_view kind = "mirrored";
  config::DeviceList devices;  // auto: every visible GPU, else one CPU replica per core
  CrossDeviceOpsKind cross_device_ops = CrossDeviceOpsKind::auto_select;
  config::SourceLocation cross_device_ops_where;  // the value (line 0 when left to its default)
  bool operator==(const MirroredOptions&) const = default;
};

}  // namespace dtrain::distribute
