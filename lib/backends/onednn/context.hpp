// The CPU backend's context: a oneDNN engine and stream per replica, layouts that are oneDNN
// memory descriptors, copies that are oneDNN reorders, and the mapping between dtrain's canonical
// shapes and oneDNN's.
//
// oneDNN always speaks of tensors in logical order (N, C, H, W) and of conv weights as
// (O, I, H, W); the physical order is the format tag. dtrain's canonical shapes are channels-last
// (N, H, W, C) and Keras' weight layouts (HWIO, dense (in, out)), so a canonical descriptor is the
// logical oneDNN dims with a channels-last tag (nhwc, hwio, io ...).
//
// Only files of backends/onednn/ include this header.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "backends/onednn/checked_memory.hpp"
#include "device/context.hpp"
#include "core/tensor.hpp"

namespace dtrain::backends::onednn {

// The device interfaces (device/context.hpp) this backend implements, by their short names.
using device::Buffer;
using device::Context;
using device::Copy;
using device::Layout;
using device::LayoutPtr;
using device::Memory;
using device::Numerics;

inline constexpr std::string_view kName = "onednn";

// The x86-64 levels the backend's own loops (lanes.hpp) are compiled for, narrowest first: plain
// x86-64 (SSE2), v3 (AVX2 with FMA), v4 (AVX-512 F, BW, DQ, VL).
enum class LoopIsa { x86_64, x86_64_v3, x86_64_v4 };
std::string_view name_of(LoopIsa isa);
// The widest level this CPU runs, capped by oneDNN's effective ISA (ONEDNN_MAX_CPU_ISA, or
// reproducibility.isa), so a cap to avx2 also moves dtrain's own loops to their AVX2 build.
LoopIsa widest_loop_isa();

dnnl::memory::data_type to_dnnl(DType dtype);

// A layout is a oneDNN memory descriptor of a logical canonical shape.
class OnednnLayout final : public Layout {
 public:
  OnednnLayout(Shape shape, DType dtype, dnnl::memory::desc md)
      : shape_(std::move(shape)), dtype_(dtype), md_(std::move(md)) {}
  const Shape& shape() const override { return shape_; }
  DType dtype() const override { return dtype_; }
  std::size_t bytes() const override { return md_.get_size(); }
  bool same_as(const Layout& other) const override;
  const dnnl::memory::desc& md() const { return md_; }

 private:
  Shape shape_;
  DType dtype_;
  dnnl::memory::desc md_;
};

// Canonical activation descriptor for a shape (N, spatial..., C) or (N, F): channels last.
dnnl::memory::desc canonical_md(const Shape& shape, DType dtype);
// Descriptor with every dimension free for oneDNN to pick a layout (format_tag::any).
dnnl::memory::desc any_md(const Shape& shape, DType dtype);
// Keras conv kernel (KH, KW, I, O) as a oneDNN weights descriptor, hwio physical order, f32.
dnnl::memory::desc hwio_md(int kh, int kw, int in, int out);
// Keras dense kernel (in, out) as a oneDNN inner-product weights descriptor (io physical order), f32.
dnnl::memory::desc io_md(int in, int out);
// The dtype of a descriptor's elements.
DType dtype_of(const dnnl::memory::desc& md);
// The descriptor of a layout this backend made.
const dnnl::memory::desc& md_of(const LayoutPtr& layout);
LayoutPtr make_layout(const Shape& shape, DType dtype, const dnnl::memory::desc& md);

class OnednnContext final : public Context {
 public:
  explicit OnednnContext(Device device);
  ~OnednnContext() override;
  // The oneDNN context of a context this backend made (InternalError otherwise).
  static OnednnContext& of(Context& ctx);

  std::string_view backend() const override { return kName; }
  Device device() const override { return device_; }
  LayoutPtr canonical_layout(const Shape& shape, DType dtype) const override;
  Buffer allocate(std::size_t bytes) override;
  Memory movable_memory(const LayoutPtr& layout) override;
  void set_address(const Memory& memory, void* data) override;
  std::unique_ptr<Copy> make_copy(const Memory& from, const Memory& to) override;
  void synchronize() override { stream.wait(); }
  // Host memory, readable in place, except in the checked mode (checked_memory.hpp).
  bool host_accessible() const override { return checked_ == nullptr; }
  void copy_to_host(const void* src, void* host, std::size_t bytes) override;
  void copy_from_host(const void* host, void* dst, std::size_t bytes) override;
  void copy_on_device(const void* src, void* dst, std::size_t bytes) override;
  void zero(void* dst, std::size_t bytes) override;
  using Context::copy_from_host;
  using Context::copy_to_host;
  using Context::zero;
  void enter() override {
    if (checked_) checked_->enter();
  }
  void leave() override {
    if (checked_) checked_->leave();
  }
  Numerics& numerics() override { return checked_numerics_ ? *checked_numerics_ : *numerics_; }
  std::string describe() const override;
  std::string cannot_compute_in(DType compute) const override;

  // The level this context's kernels build their own loops for: widest_loop_isa(), unless a test
  // chose a narrower one (before making the kernels) to run each build on one machine. Asked when a
  // kernel is made, not before: oneDNN's ISA may be capped until its first kernel.
  LoopIsa loop_isa() const { return loop_isa_ ? *loop_isa_ : widest_loop_isa(); }
  void set_loop_isa(LoopIsa isa);

  // A oneDNN memory over `m` (no copy).
  dnnl::memory wrap(const Memory& m) const;
  dnnl::memory wrap(const dnnl::memory::desc& md, void* data) const;

  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};

 private:
  Device device_;
  std::optional<LoopIsa> loop_isa_;  // set_loop_isa's choice
  std::unique_ptr<Numerics> numerics_;
  std::unique_ptr<CheckedMemory> checked_;            // the checked mode's memory, else null
  std::unique_ptr<Numerics> checked_numerics_;        // numerics_ inside calls, checked
};

// A primitive with its arguments bound once. run() goes through oneDNN's C API with the argument
// array built on the first run: the C++ execute() builds that array on every call, which would
// be an allocation in every training step.
struct BoundPrimitive {
  BoundPrimitive() = default;
  BoundPrimitive(dnnl::primitive p, std::unordered_map<int, dnnl::memory> a) : prim(std::move(p)), args(std::move(a)) {}
  dnnl::primitive prim;
  std::unordered_map<int, dnnl::memory> args;  // keeps the memories alive
  void run(OnednnContext& ctx);

 private:
  std::vector<dnnl_exec_arg_t> c_args_;
};

// Holds a reorder between two fixed memories, or nothing when they are the same memory in the same
// layout, so the hot path pays for a layout change only when oneDNN really picked another layout.
class Reorder {
 public:
  Reorder() = default;
  void bind(const dnnl::memory& src, const dnnl::memory& dst);
  void run(OnednnContext& ctx);
  // A kernel that writes the copy with loops of its own (dense.cpp's bfloat16 weights).
  void leave_to_kernel() { needed_ = false; }

 private:
  bool needed_ = false;
  BoundPrimitive prim_;
};

// The memory to compute in: `user` when the layout `want` equals it, else a new buffer of layout
// `want` (and `reorder` is bound from/to `user`). `to_user` gives the direction of the copy.
dnnl::memory layout_for(const OnednnContext& ctx, const dnnl::memory& user, const dnnl::memory::desc& want,
                        Reorder& reorder, bool to_user);

// The ISA oneDNN dispatches to on this machine, as oneDNN names it ("avx512_core_amx", ...).
std::string effective_isa();
// Whether oneDNN runs bfloat16 convolutions and inner products in hardware here (AVX512-BF16 or
// AMX); honours ONEDNN_MAX_CPU_ISA, which is how a test plays a CPU without them.
bool cpu_has_bf16();
// Whether the backend's bfloat16 weight loops take two products an instruction (VDPBF16PS): a CPU
// with AVX512-BF16 and no AMX (conv2d.cpp says why).
bool cpu_multiplies_bf16_pairs();
// oneDNN's version "2.6.3".
std::string dnnl_version();

}  // namespace dtrain::backends::onednn
