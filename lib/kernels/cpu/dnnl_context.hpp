// The oneDNN side of the CPU backend: an engine and stream per compute context, the mapping
// between dtrain's canonical (channels-last) shapes and oneDNN memory descriptors, and a small
// reorder holder that exists only when two layouts really differ.
//
// oneDNN always speaks of tensors in logical order (N, C, H, W) and of conv weights as
// (O, I, H, W); the physical order is the format tag. dtrain's canonical shapes are channels-last
// (N, H, W, C) and Keras' weight layouts (HWIO, dense (in, out)), so a canonical descriptor is the
// logical oneDNN dims with a channels-last tag (nhwc, hwio, io ...).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "core/tensor.hpp"

namespace dtrain::kernels::cpu {

// One per thread of compute (a replica later). Primitives are tied to the engine; execution to
// the stream.
struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};

// Canonical activation descriptor for a shape (N, spatial..., C) or (N, F): channels last.
dnnl::memory::desc canonical_md(const Shape& shape);
// Descriptor with every dimension free for oneDNN to pick a layout (format_tag::any).
dnnl::memory::desc any_md(const Shape& shape);
// Keras conv kernel (KH, KW, I, O) as a oneDNN weights descriptor, hwio physical order.
dnnl::memory::desc hwio_md(int kh, int kw, int in, int out);
// Keras dense kernel (in, out) as a oneDNN inner-product weights descriptor (io physical order).
dnnl::memory::desc io_md(int in, int out);
// A wrapper around user memory: no copy, the Tensor keeps ownership.
dnnl::memory wrap(const Context& ctx, const dnnl::memory::desc& md, void* data);

// A primitive with its arguments bound once. run() goes through oneDNN's C API with the argument
// array built on the first run: the C++ execute() builds that array on every call, which would
// be an allocation in every training step.
struct BoundPrimitive {
  BoundPrimitive() = default;
  BoundPrimitive(dnnl::primitive p, std::unordered_map<int, dnnl::memory> a) : prim(std::move(p)), args(std::move(a)) {}
  dnnl::primitive prim;
  std::unordered_map<int, dnnl::memory> args;  // keeps the memories alive
  void run(Context& ctx);

 private:
  std::vector<dnnl_exec_arg_t> c_args_;
};

// Holds a reorder between two fixed descriptors, or nothing when they are equal, so the hot path
// pays for a layout change only when oneDNN really picked another layout.
class Reorder {
 public:
  Reorder() = default;
  // Binds the source and destination memories; when their descriptors are equal `dst` should be
  // the same buffer as `src` (then run() does nothing).
  void bind(const Context& ctx, const dnnl::memory& src, const dnnl::memory& dst);
  void run(Context& ctx);
  bool needed() const { return needed_; }

 private:
  bool needed_ = false;
  BoundPrimitive prim_;
};

// The memory to compute in: `user` when the layout `want` equals it, else a new buffer of layout
// `want` (and `reorder` is bound from/to `user`). `to_user` gives the direction of the copy.
dnnl::memory layout_for(const Context& ctx, const dnnl::memory& user, const dnnl::memory::desc& want,
                        Reorder& reorder, bool to_user);

// The ISA oneDNN dispatches to on this machine, as oneDNN names it ("avx512_core_amx", ...).
std::string effective_isa();
// oneDNN's version "2.6.3".
std::string dnnl_version();

}  // namespace dtrain::kernels::cpu
