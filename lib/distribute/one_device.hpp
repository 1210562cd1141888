// OneDeviceStrategy: one replica, on `device`, on the calling thread.
#pragma once

#include <string>
#include <string_view>

namespace dtrain::distribute {

struct OneDeviceOptions {
  static constexpr std::string_view kind = "one_device";
  std::string device = "cpu:0";  // normalised: cpu:N or gpu:N
  bool operator==(const OneDeviceOptions&) const = default;
};

}  // namespace dtrain::distribute
