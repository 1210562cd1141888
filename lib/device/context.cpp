#include "device/context.hpp"

#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::device {

namespace {

struct Registered {
  Device::Kind kind;
  std::string_view name;
  ContextFactory factory;
  DeviceInventory inventory;
};

// Filled by the backends' registrations before main, read-only afterwards.
std::vector<Registered>& registry() {
  static std::vector<Registered> backends;
  return backends;
}

const Registered* find(Device::Kind kind) {
  for (const Registered& r : registry())
    if (r.kind == kind) return &r;
  return nullptr;
}

}  // namespace

void register_backend(Device::Kind kind, std::string_view name, ContextFactory factory, DeviceInventory inventory) {
  DTRAIN_CHECK(find(kind) == nullptr, fmt::format("two backends registered for one device kind ({} and {})",
                                                  find(kind) ? find(kind)->name : "", name));
  registry().push_back({kind, name, factory, inventory});
}

std::vector<std::string> device_inventory(Device::Kind kind) {
  const Registered* r = find(kind);
  return r && r->inventory ? r->inventory() : std::vector<std::string>{};
}

std::string_view backend_for(Device::Kind kind) {
  const Registered* r = find(kind);
  return r ? r->name : std::string_view();
}

std::unique_ptr<Context> make_context(Device device) {
  const Registered* r = find(device.kind);
  if (!r) {
    if (device.kind == Device::Kind::gpu)
      throw ConfigError(fmt::format("device {}: this build of dtrain has no CUDA backend (CUDA was not found when it "
                                    "was built); use cpu:N devices",
                                    device.to_string()));
    throw ConfigError(fmt::format("device {}: no backend in this build runs it", device.to_string()));
  }
  return r->factory(device);
}

}  // namespace dtrain::device
