#include "device/context.hpp"

#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"
#include "device/gpu_module.hpp"
#include "dtrain/build_info.hpp"

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

// Filled by the backends' registrations: the CPU's before main, the CUDA module's when it loads
// (device/gpu_module.hpp), perhaps while another thread looks a backend up. A deque: an entry
// stays where it is while others are added.
struct Registry {
  std::mutex mutex;
  std::deque<Registered> backends;
};

Registry& registry() {
  static Registry r;
  return r;
}

Registered* find_locked(Registry& r, Device::Kind kind) {
  for (Registered& entry : r.backends)
    if (entry.kind == kind) return &entry;
  return nullptr;
}

// The backend registered for `kind`, as it is now (null when none).
Registered* find(Device::Kind kind) {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  return find_locked(r, kind);
}

// The same, after loading the CUDA module where `kind` is gpu and no backend runs it yet.
const Registered* find_or_load(Device::Kind kind) {
  if (const Registered* r = find(kind)) return r;
  if (kind != Device::Kind::gpu || !load_cuda_backend().empty()) return nullptr;
  return find(kind);
}

}  // namespace

void register_backend(Device::Kind kind, std::string_view name, ContextFactory factory, DeviceInventory inventory,
                      DeviceCount count) {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  const Registered* before = find_locked(r, kind);
  DTRAIN_CHECK(before == nullptr, fmt::format("two backends registered for one device kind ({} and {})",
                                              before ? before->name : "", name));
  r.backends.push_back({kind, name, factory, inventory, count, nullptr});
}

bool backend_registered(Device::Kind kind) { return find(kind) != nullptr; }

void register_isa_cap(Device::Kind kind, IsaCap cap) {
  Registered* r = find(kind);
  DTRAIN_CHECK(r != nullptr, "an instruction-set cap registered before its backend");
  r->cap = cap;
}

void cap_instruction_set(Device::Kind kind, std::string_view isa) {
  if (const Registered* r = find_or_load(kind); r && r->cap) return r->cap(isa);
  throw ConfigError(fmt::format("the {} backend of this build cannot cap its instruction set to {}; leave "
                                "reproducibility.isa out (native)",
                                backend_for(kind).empty() ? "missing" : backend_for(kind), isa));
}

std::vector<std::string> device_inventory(Device::Kind kind) {
  const Registered* r = find_or_load(kind);
  return r && r->inventory ? r->inventory() : std::vector<std::string>{};
}

int device_count(Device::Kind kind) {
  if (kind == Device::Kind::gpu && !find(kind)) {
    // Without NVIDIA's driver the CUDA runtime finds no GPU: no need to load it to hear that.
    if (!build_info::have_cuda || !cuda_driver_present()) return 0;
    // With it, a backend that cannot load must not pass for a machine without GPUs.
    if (const std::string& why = load_cuda_backend(); !why.empty())
      throw ConfigError(fmt::format("this machine has NVIDIA's driver, but {}", why));
  }
  const Registered* r = find_or_load(kind);
  return r && r->count ? r->count() : 0;
}

std::string_view backend_for(Device::Kind kind) {
  const Registered* r = find_or_load(kind);
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
  const Registered* r = find_or_load(device.kind);
  if (!r) {
    if (device.kind == Device::Kind::gpu)
      throw ConfigError(fmt::format("device {}: {}; use cpu:N devices", device.to_string(), load_cuda_backend()));
    throw ConfigError(fmt::format("device {}: no backend in this build runs it", device.to_string()));
  }
  return r->factory(device);
}

}  // namespace dtrain::device
