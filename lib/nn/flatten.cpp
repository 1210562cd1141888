#include "nn/flatten.hpp"

#include <fmt/format.h>

namespace dtrain::nn {

using dnnl::memory;
namespace cpu = kernels::cpu;

Reshape::Reshape(std::string name, const config::ReshapeConfig& options) : Layer(std::move(name)), opt_(options) {}

Shape Reshape::build(const Shape& in, Rng&) {
  in_ = in;
  std::vector<std::int64_t> dims = opt_.target_shape;
  std::int64_t known = 1;
  int inferred = -1;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] == -1) {
      if (inferred >= 0) throw ConfigError(fmt::format("layer '{}': only one target_shape entry may be -1", name()));
      inferred = static_cast<int>(i);
    } else {
      known *= dims[i];
    }
  }
  if (inferred >= 0 && known > 0 && in.numel() % known == 0) dims[static_cast<std::size_t>(inferred)] = in.numel() / known;
  out_ = Shape(dims);
  if (out_.numel() != in.numel())
    throw ConfigError(fmt::format("layer '{}': cannot reshape {} ({} values) to {}", name(), in.to_string(), in.numel(),
                                  Shape(opt_.target_shape).to_string()));
  return out_;
}

memory::desc Reshape::plan(Context&, const memory::desc& src_md) {
  const std::int64_t n = src_md.dims()[0];
  plans_.create(n);
  return cpu::canonical_md(out_.with_batch(n));
}

void Reshape::bind(Context& ctx, std::int64_t batch, const LayerIO& io) {
  Plan& p = plans_.get(batch);
  // The output buffer seen as the input shape in canonical order: reordering into it is the
  // whole reshape.
  const memory::desc in_canonical = cpu::canonical_md(in_.with_batch(batch));
  p.fwd.bind(ctx, io.src, cpu::wrap(ctx, in_canonical, io.dst.get_data_handle()));
  if (io.diff_src) p.bwd.bind(ctx, cpu::wrap(ctx, in_canonical, io.diff_dst.get_data_handle()), io.diff_src);
}

void Reshape::forward(Context& ctx, std::int64_t batch) { plans_.get(batch).fwd.run(ctx); }

void Reshape::backward(Context& ctx, std::int64_t batch) { plans_.get(batch).bwd.run(ctx); }

}  // namespace dtrain::nn
