#include "kernels/cpu/dnnl_context.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::kernels::cpu {

using dnnl::memory;
using tag = memory::format_tag;

namespace {

memory::dims logical_dims(const Shape& s) {
  // (N, d1, ..., dk, C) -> (N, C, d1, ..., dk)
  memory::dims d;
  d.reserve(s.rank());
  d.push_back(s[0]);
  if (s.rank() >= 2) d.push_back(s[s.rank() - 1]);
  for (std::size_t i = 1; i + 1 < s.rank(); ++i) d.push_back(s[i]);
  return d;
}

tag channels_last_tag(std::size_t rank) {
  switch (rank) {
    case 1: return tag::a;
    case 2: return tag::ab;
    case 3: return tag::acb;
    case 4: return tag::acdb;
    case 5: return tag::acdeb;
    default: break;
  }
  throw InternalError(fmt::format("tensors of rank {} are not supported by the CPU backend (1 to 5)", rank));
}

}  // namespace

memory::desc canonical_md(const Shape& shape) {
  return memory::desc(logical_dims(shape), memory::data_type::f32, channels_last_tag(shape.rank()));
}

memory::desc any_md(const Shape& shape) {
  return memory::desc(logical_dims(shape), memory::data_type::f32, tag::any);
}

memory::desc hwio_md(int kh, int kw, int in, int out) {
  return memory::desc({out, in, kh, kw}, memory::data_type::f32, tag::hwio);
}

memory::desc io_md(int in, int out) { return memory::desc({out, in}, memory::data_type::f32, tag::io); }

memory wrap(const Context& ctx, const memory::desc& md, void* data) { return memory(md, ctx.engine, data); }

void BoundPrimitive::run(Context& ctx) {
  if (c_args_.size() != args.size()) {
    c_args_.clear();
    for (const auto& [key, mem] : args) c_args_.push_back({key, mem.get()});
  }
  const dnnl_status_t status =
      dnnl_primitive_execute(prim.get(), ctx.stream.get(), static_cast<int>(c_args_.size()), c_args_.data());
  if (status != dnnl_success) throw InternalError(fmt::format("oneDNN primitive execution failed (status {})", static_cast<int>(status)));
}

void Reorder::bind(const Context&, const memory& src, const memory& dst) {
  needed_ = src.get_desc() != dst.get_desc() || src.get_data_handle() != dst.get_data_handle();
  if (needed_) prim_ = {dnnl::reorder(src, dst), {{DNNL_ARG_FROM, src}, {DNNL_ARG_TO, dst}}};
}

void Reorder::run(Context& ctx) {
  if (needed_) prim_.run(ctx);
}

memory layout_for(const Context& ctx, const memory& user, const memory::desc& want, Reorder& reorder, bool to_user) {
  if (user.get_desc() == want) {
    reorder = Reorder();
    return user;
  }
  memory m(want, ctx.engine);
  if (to_user) {
    reorder.bind(ctx, m, user);
  } else {
    reorder.bind(ctx, user, m);
  }
  return m;
}

std::string effective_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic: return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops: return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    default: return "unknown";
  }
}

std::string dnnl_version() {
  const dnnl_version_t* v = ::dnnl_version();
  return fmt::format("{}.{}.{}", v->major, v->minor, v->patch);
}

}  // namespace dtrain::kernels::cpu
