#include "backends/onednn/context.hpp"

#include <algorithm>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "backends/onednn/numerics.hpp"
#include "core/bfloat16.hpp"
#include "core/error.hpp"

namespace dtrain::backends::onednn {

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

class ReorderCopy final : public Copy {
 public:
  ReorderCopy(OnednnContext& ctx, const memory& from, const memory& to) : ctx_(ctx) { reorder_.bind(from, to); }
  void run() override {
    Context::Call call(ctx_);
    reorder_.run(ctx_);
  }

 private:
  OnednnContext& ctx_;
  Reorder reorder_;
};

// f32 <-> bf16 between two layouts that differ only in the element type (element k of one buffer
// is element k of the other). oneDNN 2.6's reorders emulate the conversions on CPUs without
// bfloat16 instructions and there turn -0.0 into +0.0 both ways, so the same copy gave other bits
// on an AVX2 machine than on an AVX512-BF16 one; these loops give the instruction's bits on every
// CPU (widening is exact: bfloat16 is the high half of a float).
class ConversionCopy final : public Copy {
 public:
  ConversionCopy(OnednnContext& ctx, const memory& from, const memory& to)
      : ctx_(ctx), from_(from), to_(to), narrowing_(from.get_desc().data_type() == memory::data_type::f32),
        count_(to.get_desc().get_size() / (narrowing_ ? sizeof(std::uint16_t) : sizeof(float))) {}
  void run() override {
    Context::Call call(ctx_);
    if (narrowing_) {
      const auto* from = static_cast<const std::uint32_t*>(from_.get_data_handle());
      auto* to = static_cast<std::uint16_t*>(to_.get_data_handle());
      for (std::size_t k = 0; k < count_; ++k) to[k] = bf16_from_f32_bits(from[k]);
    } else {
      const auto* from = static_cast<const std::uint16_t*>(from_.get_data_handle());
      auto* to = static_cast<std::uint32_t*>(to_.get_data_handle());
      for (std::size_t k = 0; k < count_; ++k) to[k] = std::uint32_t{from[k]} << 16;
    }
  }

 private:
  OnednnContext& ctx_;
  memory from_, to_;
  bool narrowing_;
  std::size_t count_;
};

// Whether one of the two is the other laid out alike with bf16 elements instead of f32.
bool converts_alike(const memory::desc& from, const memory::desc& to) {
  const bool narrowing = from.data_type() == memory::data_type::f32 && to.data_type() == memory::data_type::bf16;
  const bool widening = from.data_type() == memory::data_type::bf16 && to.data_type() == memory::data_type::f32;
  if (!narrowing && !widening) return false;
  memory::desc retyped = from;
  retyped.data.data_type = to.data.data_type;
  return retyped == to && retyped.get_size() == to.get_size();
}

std::unique_ptr<Context> make(Device device) { return std::make_unique<OnednnContext>(device); }

// reproducibility.isa: oneDNN's maximum ISA, which it lets a process set once, before its first
// kernel. The cap made is remembered so that another trainer in the same process (a test, an
// evaluation after training) may ask for the same one again.
void cap_isa(std::string_view name) {
  static const std::pair<std::string_view, dnnl::cpu_isa> isas[] = {
      {"avx2", dnnl::cpu_isa::avx2},
      {"avx512_core", dnnl::cpu_isa::avx512_core},
      {"avx512_core_bf16", dnnl::cpu_isa::avx512_core_bf16},
      {"avx512_core_amx", dnnl::cpu_isa::avx512_core_amx}};
  const auto* chosen = std::find_if(std::begin(isas), std::end(isas), [&](const auto& i) { return i.first == name; });
  DTRAIN_CHECK(chosen != std::end(isas), fmt::format("no oneDNN ISA named {}", name));
  static std::string_view capped;  // what this process's oneDNN was capped to
  if (capped == chosen->first) return;
  if (!capped.empty() || dnnl::set_max_cpu_isa(chosen->second) != dnnl::status::success)
    throw ConfigError(fmt::format("oneDNN's instruction set cannot be capped to {} any more in this process (it was "
                                  "{}): it is fixed before the first kernel; run the experiment in a process of its own",
                                  name, capped.empty() ? "fixed by an earlier kernel" : fmt::format("capped to {}", capped)));
  capped = chosen->first;
  const auto want = static_cast<unsigned>(chosen->second);
  if ((static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & want) != want)
    throw ConfigError(fmt::format("this CPU does not have the {} instructions (oneDNN finds {}); choose an instruction "
                                  "set it has, or leave reproducibility.isa out",
                                  name, effective_isa()));
}

const bool registered = (device::register_backend(Device::Kind::cpu, kName, &make),
                          device::register_isa_cap(Device::Kind::cpu, &cap_isa), true);

}  // namespace

memory::data_type to_dnnl(DType dtype) {
  switch (dtype) {
    case DType::f32: return memory::data_type::f32;
    case DType::bf16: return memory::data_type::bf16;
    case DType::u8: return memory::data_type::u8;
    case DType::i32: return memory::data_type::s32;
  }
  throw InternalError("unknown dtype");
}

DType dtype_of(const memory::desc& md) {
  switch (md.data_type()) {
    case memory::data_type::f32: return DType::f32;
    case memory::data_type::bf16: return DType::bf16;
    case memory::data_type::u8: return DType::u8;
    case memory::data_type::s32: return DType::i32;
    default: break;
  }
  throw InternalError("a oneDNN memory of a dtype dtrain does not use");
}

bool OnednnLayout::same_as(const Layout& other) const {
  const auto* o = dynamic_cast<const OnednnLayout*>(&other);
  return o && o->md_ == md_;
}

memory::desc canonical_md(const Shape& shape, DType dtype) {
  if (shape.rank() <= 5) return memory::desc(logical_dims(shape), to_dnnl(dtype), channels_last_tag(shape.rank()));
  // oneDNN names channels-last layouts up to rank 5 only; a larger rank (a reshape's or an input
  // shape's, up to Shape::kMaxRank) is the same row-major order spelt with strides.
  const std::size_t rank = shape.rank();
  std::vector<memory::dim> row_major(rank);
  memory::dim stride = 1;
  for (std::size_t i = rank; i-- > 0;) {
    row_major[i] = stride;
    stride *= shape[i];
  }
  // In logical_dims' order: (N, C, d1, ..., dk).
  memory::dims strides{row_major[0], row_major[rank - 1]};
  for (std::size_t i = 1; i + 1 < rank; ++i) strides.push_back(row_major[i]);
  return memory::desc(logical_dims(shape), to_dnnl(dtype), strides);
}

memory::desc any_md(const Shape& shape, DType dtype) { return memory::desc(logical_dims(shape), to_dnnl(dtype), tag::any); }

memory::desc hwio_md(int kh, int kw, int in, int out) {
  return memory::desc({out, in, kh, kw}, memory::data_type::f32, tag::hwio);
}

memory::desc io_md(int in, int out) { return memory::desc({out, in}, memory::data_type::f32, tag::io); }

const memory::desc& md_of(const LayoutPtr& layout) {
  const auto* l = dynamic_cast<const OnednnLayout*>(layout.get());
  DTRAIN_CHECK(l != nullptr, "a layout of another backend reached the oneDNN backend");
  return l->md();
}

LayoutPtr make_layout(const Shape& shape, DType dtype, const memory::desc& md) {
  return std::make_shared<OnednnLayout>(shape, dtype, md);
}

OnednnContext::OnednnContext(Device device)
    : device_(device), numerics_(std::make_unique<CpuNumerics>()) {
  if (device.kind != Device::Kind::cpu) throw InternalError("the oneDNN backend runs cpu devices only");
  if (CheckedMemory::requested()) {
    checked_ = std::make_unique<CheckedMemory>();
    checked_numerics_ = checked_numerics(*numerics_, *checked_, *this);
  }
}

OnednnContext::~OnednnContext() = default;

OnednnContext& OnednnContext::of(Context& ctx) {
  auto* c = dynamic_cast<OnednnContext*>(&ctx);
  DTRAIN_CHECK(c != nullptr, "a oneDNN kernel was made for a context of another backend");
  return *c;
}

LayoutPtr OnednnContext::canonical_layout(const Shape& shape, DType dtype) const {
  return make_layout(shape, dtype, canonical_md(shape, dtype));
}

Buffer OnednnContext::allocate(std::size_t bytes) {
  if (checked_) return checked_->allocate(bytes);
  // 64-byte alignment for AVX-512 loads; aligned_alloc wants a multiple of the alignment.
  const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  return Buffer(p, [](void* q) { std::free(q); });
}

// The copies are memcpy: the CPU backend's stream runs each primitive to completion before
// returning, so there is nothing queued to wait for.
void OnednnContext::copy_to_host(const void* src, void* host, std::size_t bytes) {
  Call call(*this);
  if (bytes) std::memcpy(host, src, bytes);
}

void OnednnContext::copy_from_host(const void* host, void* dst, std::size_t bytes) {
  Call call(*this);
  if (bytes) std::memcpy(dst, host, bytes);
}

void OnednnContext::copy_on_device(const void* src, void* dst, std::size_t bytes) {
  Call call(*this);
  if (bytes) std::memmove(dst, src, bytes);
}

void OnednnContext::zero(void* dst, std::size_t bytes) {
  Call call(*this);
  if (bytes) std::memset(dst, 0, bytes);
}

Memory OnednnContext::movable_memory(const LayoutPtr& layout) {
  Memory m;
  m.layout = layout;
  m.handle = std::make_shared<memory>(md_of(layout), engine, static_cast<void*>(DNNL_MEMORY_NONE));
  return m;
}

void OnednnContext::set_address(const Memory& m, void* data) {
  DTRAIN_CHECK(m.handle != nullptr, "set_address() on memory that movable_memory() did not make");
  static_cast<memory*>(m.handle.get())->set_data_handle(data);
}

std::unique_ptr<Copy> OnednnContext::make_copy(const Memory& from, const Memory& to) {
  if (from.data == to.data && !from.handle && !to.handle && from.layout->same_as(*to.layout)) return nullptr;
  if (converts_alike(md_of(from.layout), md_of(to.layout)))
    return std::make_unique<ConversionCopy>(*this, wrap(from), wrap(to));
  return std::make_unique<ReorderCopy>(*this, wrap(from), wrap(to));
}

void OnednnContext::set_loop_isa(LoopIsa isa) {
  if (static_cast<int>(isa) > static_cast<int>(widest_loop_isa()))
    throw ConfigError(fmt::format("the CPU backend's loops cannot run as {} here: the widest this CPU (oneDNN isa {}) "
                                  "runs is {}",
                                  name_of(isa), effective_isa(), name_of(widest_loop_isa())));
  loop_isa_ = isa;
}

std::string OnednnContext::describe() const { return fmt::format("oneDNN {} isa {}", dnnl_version(), effective_isa()); }

memory OnednnContext::wrap(const Memory& m) const {
  // A movable memory is the same oneDNN object everywhere, so set_address() reaches every user.
  if (m.handle) return *static_cast<const memory*>(m.handle.get());
  return memory(md_of(m.layout), engine, m.data);
}

memory OnednnContext::wrap(const memory::desc& md, void* data) const { return memory(md, engine, data); }

void BoundPrimitive::run(OnednnContext& ctx) {
  if (c_args_.size() != args.size()) {
    c_args_.clear();
    for (const auto& [key, mem] : args) c_args_.push_back({key, mem.get()});
  }
  const dnnl_status_t status =
      dnnl_primitive_execute(prim.get(), ctx.stream.get(), static_cast<int>(c_args_.size()), c_args_.data());
  if (status != dnnl_success)
    throw InternalError(fmt::format("oneDNN primitive execution failed (status {})", static_cast<int>(status)));
}

void Reorder::bind(const memory& src, const memory& dst) {
  needed_ = src.get_desc() != dst.get_desc() || src.get_data_handle() != dst.get_data_handle();
  if (needed_) prim_ = {dnnl::reorder(src, dst), {{DNNL_ARG_FROM, src}, {DNNL_ARG_TO, dst}}};
}

void Reorder::run(OnednnContext& ctx) {
  if (needed_) prim_.run(ctx);
}

memory layout_for(const OnednnContext& ctx, const memory& user, const memory::desc& want, Reorder& reorder,
                  bool to_user) {
  if (user.get_desc() == want) {
    reorder = Reorder();
    return user;
  }
  memory m(want, ctx.engine);
  if (to_user) {
    reorder.bind(m, user);
  } else {
    reorder.bind(user, m);
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

std::string_view name_of(LoopIsa isa) {
  switch (isa) {
    case LoopIsa::x86_64: return "x86-64";
    case LoopIsa::x86_64_v3: return "x86-64-v3";
    case LoopIsa::x86_64_v4: return "x86-64-v4";
  }
  return "unknown";
}

LoopIsa widest_loop_isa() {
  // cpu_isa values are bit sets: an ISA includes every bit of the ones it extends.
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto has = [isa](dnnl::cpu_isa want) { return (isa & static_cast<unsigned>(want)) == static_cast<unsigned>(want); };
  if (__builtin_cpu_supports("x86-64-v4") && has(dnnl::cpu_isa::avx512_core)) return LoopIsa::x86_64_v4;
  if (__builtin_cpu_supports("x86-64-v3") && has(dnnl::cpu_isa::avx2)) return LoopIsa::x86_64_v3;
  return LoopIsa::x86_64;
}

bool cpu_has_bf16() {
  // cpu_isa values are bit sets: an ISA includes every bit of the ones it extends.
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  return (isa & bf16) == bf16;
}

std::string OnednnContext::cannot_compute_in(DType compute) const {
  switch (compute) {
    case DType::f32: return {};
    case DType::bf16:
      if (cpu_has_bf16()) return {};
      // The CPU may have them with oneDNN capped below them (reproducibility.isa, ONEDNN_MAX_CPU_ISA).
      if (__builtin_cpu_supports("avx512bf16"))
        return fmt::format("oneDNN is capped to isa {} (reproducibility.isa, or ONEDNN_MAX_CPU_ISA), below the "
                           "avx512_core_bf16 that bfloat16 needs, which this CPU has; lift the cap",
                           effective_isa());
      return fmt::format("this CPU has no bfloat16 instructions (oneDNN dispatches to isa {}; bfloat16 needs "
                         "avx512_core_bf16 or avx512_core_amx)",
                         effective_isa());
    default: return fmt::format("the CPU backend does not compute in {}", dtype_name(compute));
  }
}

std::string dnnl_version() {
  const dnnl_version_t* v = ::dnnl_version();
  return fmt::format("{}.{}.{}", v->major, v->minor, v->patch);
}

}  // namespace dtrain::backends::onednn
