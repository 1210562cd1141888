// CentralStorageStrategy: one replica per device (own thread) and ONE copy of the variables, held
// by the replica on `parameter_device` (on CPU devices the copy lives with the replica of that
// device). The other replicas compute with its values; the gradients are summed onto it
// (reduction_to_one_device) and it alone applies the update.
#pragma once

#include <string>
#include <string_view>

#include "config/experiment.hpp"

namespace dtrain::distribute {

struct CentralStorageOptions {
  static constexpr std::string_view kind = "central_storage";
  config::DeviceList devices;  // auto: one CPU replica per core
  std::string parameter_device = "cpu:0";
  config::SourceLocation parameter_device_where;  // the value (line 0 when left to its default)
  bool operator==(const CentralStorageOptions&) const = default;
};

}  // namespace dtrain::distribute
