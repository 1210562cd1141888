#include "device/context.hpp"

#include <cstring>
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
  DeviceCount count;
  IsaCap cap = nullptr;  // register_isa_cap's, when the backend has one
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

void register_backend(Device::Kind kind, std::string_view name, ContextFactory factory, DeviceInventory inventory,
                      DeviceCount count) {
  DTRAIN_CHECK(find(kind) == nullptr, fmt::format("two backends registered for one device kind ({} and {})",
                                                  find(kind) ? find(kind)->name : "", name));
  registry().push_back({kind, name, factory, inventory, count, nullptr});
}

void register_isa_cap(Device::Kind kind, IsaCap cap) {
  DTRAIN_CHECK(find(kind) != nullptr, "an instruction-set cap registered before its backend");
  for (Registered& r : registry())
    if (r.kind == kind) r.cap = cap;
}

void cap_instruction_set(Device::Kind kind, std::string_view isa) {
  if (const Registered* r = find(kind); r && r->cap) return r->cap(isa);
  throw ConfigError(fmt::format("the {} backend of this build cannot cap its instruction set to {}; leave "
                                "reproducibility.isa out (native)",
                                backend_for(kind).empty() ? "missing" : backend_for(kind), isa));
}

std::vector<std::string> device_inventory(Device::Kind kind) {
  const Registered* r = find(kind);
  return r && r->inventory ? r->inventory() : std::vector<std::string>{};
}

int device_count(Device::Kind kind) {
  const Registered* r = find(kind);
  return r && r->count ? r->count() : 0;
}

std::string_view backend_for(Device::Kind kind) {
  const Registered* r = find(kind);
  return r ? r->name : std::string_view();
}

Tensor Context::tensor(const Shape& shape, DType dtype) {
  const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  Buffer memory = allocate(bytes);
  return Tensor(shape, dtype, std::make_shared<Storage>(std::move(memory), bytes, device(), host_accessible()));
}

Tensor Context::upload(const Tensor& host) {
  Tensor t = tensor(host.shape(), host.dtype());
  DTRAIN_CHECK(host.host_accessible(), "upload() of a tensor that is not in host memory");
  if (t.bytes()) copy_from_host(host.raw(), t.raw(), t.bytes());
  return t;
}

Tensor Context::download(const Tensor& t) {
  Tensor host(t.shape(), t.dtype());
  if (!t.bytes()) return host;
  if (t.host_accessible()) {
    std::memcpy(host.raw(), t.raw(), t.bytes());
  } else {
    copy_to_host(t.raw(), host.raw(), t.bytes());
  }
  return host;
}

void Context::copy_to_host(const Tensor& src, void* host) {
  if (src.bytes()) copy_to_host(src.raw(), host, src.bytes());
}

void Context::copy_from_host(const void* host, Tensor& dst) {
  if (dst.bytes()) copy_from_host(host, dst.raw(), dst.bytes());
}

void Context::copy(const Tensor& src, Tensor& dst) {
  DTRAIN_CHECK(src.bytes() == dst.bytes(), fmt::format("a copy from {} bytes into {}", src.bytes(), dst.bytes()));
  if (src.bytes() && src.raw() != dst.raw()) copy_on_device(src.raw(), dst.raw(), src.bytes());
}

void Context::zero(Tensor& t) {
  if (t.bytes()) zero(t.raw(), t.bytes());
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
