// The wiring Conv2D and Dense share on oneDNN: a forward primitive with a kernel and a bias, its
// backward-data and backward-weights primitives, the fused activation, and the reorders between
// the layouts oneDNN picked (format_tag::any) and the layouts of the model's memories and of the
// Keras-layout variables. A reorder exists only where two layouts really differ.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "backends/onednn/activation_fn.hpp"
#include "backends/onednn/context.hpp"
#include "core/variable.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::onednn {

// A layer's memories as oneDNN memories; diff_src is empty (null) for the first layer.
struct DnnlIO {
  dnnl::memory src, dst, diff_dst, diff_src;
};
DnnlIO wrap_io(const OnednnContext& ctx, const nn::LayerIO& io);

struct WeightedOpPlan {
  // Filled by the layer's plan().
  dnnl::primitive_desc fwd_pd, bwd_data_pd, bwd_weights_pd;
  dnnl::primitive fwd_prim, bwd_data_prim, bwd_weights_prim;
  // Filled by bind_weighted_op().
  Reorder src_in, weights_in;                          // forward inputs into oneDNN's layouts
  Reorder bw_src_in, bw_diff_dst_in, dw_out;           // backward weights
  Reorder bd_weights_in, bd_diff_dst_in, bd_diff_src_out;  // backward data
  BoundPrimitive fwd, bwd_weights, bwd_data;
  ActivationFn::Plan act;
  bool has_diff_src = false;
  // Where the layer above reads only the leading rows and columns of the output (LayerKernel::
  // output_read_within), the three primitives compute on those alone. The output and its gradient
  // are the leading `dst` (N, F, OH', OW') itself: the layer's output layout is the forward's dst,
  // whose descriptor has fewer rows or columns than the layer's output shape, and the layer above
  // (a pooling, Layer::input_extent_read, or a convolution that crops too, LayerKernel::
  // input_read_within) reads the positions that layout holds. The input and its gradient are the
  // leading `src` (N, C, H', W') too where the layer below computed that part alone
  // (input_is_part); elsewhere the model's whole memories, and the primitives run on copies of the
  // input's leading part and into a copy of the input gradient's, arranged as the whole is
  // (channels innermost), then reordered for the primitive where it chose otherwise. The input
  // gradient's positions past `src` are +0 (the layer above reads nothing they feed).
  struct Crop {
    dnnl::memory::dims src, dst;
  };
  std::optional<Crop> crop;
  bool input_is_part = false;
  dnnl::memory src_whole, diff_src_whole;  // the model's memories
  dnnl::memory src_part, diff_src_part;    // their leading parts (input_is_part: the same memories)
};

// kernel_md: the Keras layout of the kernel variable (hwio_md / io_md). bias may be null.
void bind_weighted_op(OnednnContext& ctx, const DnnlIO& io, const dnnl::memory::desc& kernel_md, Variable& kernel,
                      Variable* bias, const ActivationFn& act, WeightedOpPlan& plan);

// A matmul C (M, N) = A (M, K) B (K, N), or C += A B where `accumulate`, on descriptors with
// explicit strides (a transposed operand is a stride), with a scratchpad the caller owns
// (scratchpad_mode::user: oneDNN's own would be allocated and released on every call), where
// oneDNN runs it on AMX; nothing elsewhere. The bfloat16 weights' gradients of Conv2D and Dense
// are such matmuls where the CPU has AMX: oneDNN 2.6's backward-weights primitives there ran 2.5-8
// times slower than its matmul on the same sums (2-core Intel Xeon with AMX). Without AMX its
// AVX512-BF16 matmul (brg:avx512_core_bf16) gained nothing: the seed CNN's dense weights' gradient,
// 0.064 ms against 0.066 for the primitive (x64:gemm:jit), medians of 440 calls (2-core AVX512-BF16
// EPYC, Zen 4).
std::optional<dnnl::matmul::primitive_desc> amx_matmul(const OnednnContext& ctx, const dnnl::memory::desc& a,
                                                       const dnnl::memory::desc& b, const dnnl::memory::desc& c,
                                                       bool accumulate);

// `bytes` of `storage` from an address aligned to a cache line, for a user-mode scratchpad.
void* aligned_scratchpad(std::vector<std::byte>& storage, std::size_t bytes);

// db[f] = the sum over p of dy[p][f], for `rows` rows of `columns` bfloat16 (float) values, in row order:
// a bias's gradient from the gradient before the activation.
void bf16_column_sums(const std::uint16_t* dy, std::int64_t rows, std::int64_t columns, float* db);
void f32_column_sums(const float* dy, std::int64_t rows, std::int64_t columns, float* db);

// The f32 Keras dense kernel (in, out) as oneDNN's bfloat16 weights of (out, in) in the blocks its
// inner product reads, AB<P>b<X>a2b with P = `pairs` (16 on AMX, 8 with AVX512-BF16) and X =
// `block` outputs (16, 32 or 64), into `at` (the layout's whole size, padding included): what
// oneDNN's reorder writes, bit for bit, written by Dense on every forward in its place.
void kernel_to_pair_blocks(const float* kernel, std::int64_t in, std::int64_t out, std::int64_t pairs,
                           std::int64_t block, std::uint32_t* at);

// Whether a Dense layer of `batch` rows, `in` inputs and `out` units is small enough for dense.cpp's
// own loops (which it runs where its layouts and activation allow them); tests ask it to know
// which path their shapes take.
bool dense_loops_pay(std::int64_t batch, std::int64_t in, std::int64_t out);

// The kernel of a layer with a kernel, a bias and a fused activation (Conv2D, Dense): the layer's
// kernel file creates the three primitive descriptors in plan() and says how its kernel variable
// is laid out in bind(); the rest is shared.
class WeightedOpKernel : public nn::LayerKernel {
 public:
  void forward(std::int64_t batch, const nn::StepContext&) override;
  void backward(std::int64_t batch, const nn::StepContext&) override;
  config::Activation output_activation() const override { return act_.kind(); }
  void skip_activation_backward() override { activation_backward_elsewhere_ = true; }

 protected:
  // A layer with a softmax computes in f32 whatever the policy (a softmax wants float32).
  WeightedOpKernel(OnednnContext& ctx, DType compute, config::Activation activation)
      : ctx_(ctx), compute_(activation == config::Activation::softmax ? DType::f32 : compute), act_(activation) {}
  // The descriptor oneDNN fills the kernel's gradient in: f32 whatever the compute dtype, so
  // bfloat16 layers hand float32 gradients to the cross-replica sum and the optimizer.
  static dnnl::memory::desc diff_weights_md(const dnnl::memory::desc& weights) {
    return dnnl::memory::desc(weights.dims(), dnnl::memory::data_type::f32, dnnl::memory::format_tag::any);
  }
  // Keeps the primitive descriptors for `batch`, makes their primitives, and returns the layout of
  // the output (`out`): the forward's dst (cropped: its leading part, WeightedOpPlan::Crop).
  LayoutPtr keep(std::int64_t batch, const Shape& out, const dnnl::primitive_desc& fwd,
                 const dnnl::primitive_desc& bwd_data, const dnnl::primitive_desc& bwd_weights,
                 const std::optional<WeightedOpPlan::Crop>& crop = std::nullopt);
  void bind_variables(std::int64_t batch, const nn::LayerIO& io, const dnnl::memory::desc& kernel_md,
                      Variable& kernel, Variable* bias);
  // A layer's own loops for its variables' gradients, run in place of oneDNN's backward-weights
  // primitive where they are faster (own_weight_gradients(batch)), after the input's gradient:
  // `pre_grad` is the gradient before the activation.
  virtual bool own_weight_gradients(std::int64_t /*batch*/) const { return false; }
  // Whether those loops apply the activation's derivative themselves, reading the gradient after
  // the activation and its output (a layer that computes no input gradient): `pre_grad` is then
  // the gradient after it, and the activation's backward does not run.
  virtual bool weight_gradients_apply_activation_derivative(std::int64_t /*batch*/) const { return false; }
  virtual void weight_gradients(std::int64_t /*batch*/, const dnnl::memory& /*pre_grad*/, const nn::StepContext&) {}
  // The plan of a batch bind_variables bound, for a layer that computes from its memories.
  WeightedOpPlan& plan_of(std::int64_t batch) { return plans_.get(batch); }

  OnednnContext& ctx_;
  DType compute_;
  ActivationFn act_;
  // The layer above applies the activation's derivative to the gradient it hands down.
  bool activation_backward_elsewhere_ = false;

 private:
  void input_gradient(WeightedOpPlan& p);

  nn::PlanCache<WeightedOpPlan> plans_;
};

}  // namespace dtrain::backends::onednn
