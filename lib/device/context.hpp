// The backend seam: what the backend-neutral modules (nn, losses, metrics, optim) ask of the device
// a replica computes on. One Context per replica; its backend is the one registered for the
// replica's device kind (onednn for cpu:N; cuda for gpu:N when built with CUDA).
//
//   Layout   how a tensor sits in the backend's memory (oneDNN: a memory descriptor, perhaps a
//            blocked one). nn hands layouts from layer to layer and compares them; it never looks
//            inside.
//   Memory   a layout and a pointer to device memory holding it.
//   Copy     a prepared copy between two memories of one logical shape: a layout change (reorder),
//            or a dtype change (f32 <-> the compute dtype).
//   Numerics the loops of the losses, metrics, optimizers and regularizers (device/numerics.hpp).
//
// Memory. Everything a step touches (variables, gradients, optimizer slots, activations, the
// staged input batch, a model's outputs) is allocated by the replica's context (allocate(),
// tensor()) and lives where its backend keeps it. The host reaches it only through the
// directional copies below (copy_to_host, copy_from_host), unless host_accessible() says it may
// read it in place (the CPU backend, outside its checked mode), where callers may skip a staging
// copy. Work is queued on the context's one ordered stream: a copy or a kernel starts after
// everything submitted before it; copy_to_host() returns with the bytes on the host.
//
// Calls. The CPU backend's checked mode (DTRAIN_CHECKED_MEMORY=1) makes its memory inaccessible
// outside the backend's own calls, so a host access the seam does not allow faults. A call into
// the backend is a Call scope (Context::Call); the context's own copies, numerics and kernels
// (nn/kernel.cpp wraps them) open one.
//
// The layer kernels are declared by nn (nn/kernel.hpp) and registered by each backend's folder;
// nothing outside backends/<name>/ includes a backend's own headers.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "device/numerics.hpp"
#include "core/tensor.hpp"

namespace dtrain::device {

class Layout {
 public:
  virtual ~Layout() = default;
  // The logical shape in canonical order (N, ..., C) and the element type.
  virtual const Shape& shape() const = 0;
  virtual DType dtype() const = 0;
  // What a buffer in this layout needs (blocked layouts may pad).
  virtual std::size_t bytes() const = 0;
  // The same physical layout (same shape, dtype and element order).
  virtual bool same_as(const Layout& other) const = 0;
};
using LayoutPtr = std::shared_ptr<const Layout>;

struct Memory {
  Memory() = default;
  Memory(LayoutPtr l, void* d) : layout(std::move(l)), data(d) {}
  LayoutPtr layout;
  void* data = nullptr;  // owned elsewhere (a Buffer, a Tensor)
  // Memory whose address changes every step (the model's input batch): the backend's own handle,
  // which kernels bind once and Context::set_address() repoints.
  std::shared_ptr<void> handle;
  explicit operator bool() const { return data != nullptr || handle != nullptr; }
};

// Device memory owned by whoever holds the pointer.
using Buffer = std::shared_ptr<void>;

class Copy {
 public:
  virtual ~Copy() = default;
  virtual void run() = 0;
};

class Context {
 public:
  virtual ~Context() = default;
  // Which kernels run here: "onednn", "cuda".
  virtual std::string_view backend() const = 0;
  virtual Device device() const = 0;
  // Canonical (channels-last, row-major) layout of `shape`: what crosses module boundaries.
  virtual LayoutPtr canonical_layout(const Shape& shape, DType dtype) const = 0;
  // Zero-filled device memory, aligned for the backend's kernels.
  virtual Buffer allocate(std::size_t bytes) = 0;
  // Memory of `layout` at an address given later, and again each step, by set_address().
  virtual Memory movable_memory(const LayoutPtr& layout) = 0;
  virtual void set_address(const Memory& memory, void* data) = 0;
  // A copy `from` -> `to` (same logical shape); null when they are the same memory in the same layout.
  virtual std::unique_ptr<Copy> make_copy(const Memory& from, const Memory& to) = 0;
  // Returns when everything submitted so far has finished (results readable, buffers reusable).
  virtual void synchronize() = 0;
  // The ordered stream as the backend's own handle, for a library that queues work on it itself
  // (NCCL's collectives take the cuda backend's cudaStream_t); null where the backend has none
  // (the CPU's work runs when it is called).
  virtual void* native_stream() { return nullptr; }

  // ---- memory and the host (see the top of the file)
  // Whether host code may read and write this context's memory in place.
  virtual bool host_accessible() const = 0;
  // `bytes` from this context's memory at `src` to host memory at `host`, after the work queued
  // before it; returns when `host` holds them.
  virtual void copy_to_host(const void* src, void* host, std::size_t bytes) = 0;
  // `bytes` from host memory at `host` to this context's memory at `dst`, ordered after the work
  // queued before it; returns when `host` may be reused.
  virtual void copy_from_host(const void* host, void* dst, std::size_t bytes) = 0;
  // Between two places of this context's memory, ordered on its stream.
  virtual void copy_on_device(const void* src, void* dst, std::size_t bytes) = 0;
  // dst[0, bytes) = 0, ordered on its stream.
  virtual void zero(void* dst, std::size_t bytes) = 0;

  // The host hands control to the backend for one call (a kernel's forward, a copy); the memory
  // of a checked context is accessible inside. Nested and concurrent calls are allowed.
  virtual void enter() {}
  virtual void leave() {}
  class Call {
   public:
    explicit Call(Context& ctx) : ctx_(ctx) { ctx_.enter(); }
    ~Call() { ctx_.leave(); }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    Context& ctx_;
  };

  // ---- conveniences over the above (device/context.cpp)
  // A zero-filled tensor of `shape` in this context's memory.
  Tensor tensor(const Shape& shape, DType dtype = DType::f32);
  // A tensor of this context holding a copy of host tensor `host` (same shape and dtype).
  Tensor upload(const Tensor& host);
  // A host tensor holding a copy of `t` (a tensor of this context, or a host tensor).
  Tensor download(const Tensor& t);
  // `t` itself where the host reads it in place, else download(t): for reading it once.
  Tensor on_host(const Tensor& t) { return t.host_accessible() ? t : download(t); }
  // Whole-tensor copies of equal byte size: host <-> this context, and within this context.
  void copy_to_host(const Tensor& src, void* host);
  void copy_from_host(const void* host, Tensor& dst);
  void copy(const Tensor& src, Tensor& dst);
  void zero(Tensor& t);
  virtual Numerics& numerics() = 0;
  // "oneDNN 2.6.3 isa avx2": what the run header says about the backend.
  virtual std::string describe() const = 0;
  // Empty when this device's kernels compute in `compute` (the dtype of a precision policy); else
  // why not, in words for the user ("this CPU has no bfloat16 instructions (isa avx2)").
  virtual std::string cannot_compute_in(DType compute) const = 0;
};

// The context for `device`, from the backend registered for its kind. ConfigError, saying what is
// missing, when no backend in this build can run it (or the CUDA module cannot load, and why).
std::unique_ptr<Context> make_context(Device device);

// How a backend makes its contexts; registered once per device kind (by the backend's folder:
// backends/onednn for cpu before main; backends/cuda for gpu, where CUDA was found, as its module
// loads: device/gpu_module.hpp). The functions below load that module the first time they are
// asked about gpu.
using ContextFactory = std::unique_ptr<Context> (*)(Device device);
// What a backend says, for `dtrain info`, about the devices of its kind this machine has and the
// library versions it was built with and finds at run time: lines without a trailing newline.
// It must not fail where the machine has no such device (it says so instead).
using DeviceInventory = std::vector<std::string> (*)();
// How many devices of its kind the machine lets it use (0 where it has none or no driver): what
// `devices: auto` takes. Without one the kind counts 0.
using DeviceCount = int (*)();
void register_backend(Device::Kind kind, std::string_view name, ContextFactory factory,
                      DeviceInventory inventory = nullptr, DeviceCount count = nullptr);
// Caps the instruction set the backend of a device kind compiles its kernels for
// (reproducibility.isa: "avx2", "avx512_core", ...), so that they are the same on every machine
// that has at least that set. Called before the kind's first context exists; ConfigError when the
// machine lacks the set or the backend cannot cap it (saying why). Registered by the backend.
using IsaCap = void (*)(std::string_view isa);
void register_isa_cap(Device::Kind kind, IsaCap cap);
void cap_instruction_set(Device::Kind kind, std::string_view isa);
// The backend registered for a device kind ("" when none).
std::string_view backend_for(Device::Kind kind);
// Whether a backend is registered for the kind now: loads nothing (the CUDA module's loader asks,
// so that a binary with the backend linked in, dtrain_gpu_tests, does not load it twice).
bool backend_registered(Device::Kind kind);
// Its inventory (empty when it has none, or no backend is registered for the kind).
std::vector<std::string> device_inventory(Device::Kind kind);
// The usable devices of a kind (0 when no backend of this build runs it, or the machine has none;
// for gpu, without NVIDIA's driver, 0 before loading anything). ConfigError, saying why, where the
// machine has that driver but the CUDA module cannot load.
int device_count(Device::Kind kind);

}  // namespace dtrain::device
