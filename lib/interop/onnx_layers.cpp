// One ONNX emitter per layer kind, each registered by its kind (interop/onnx_graph.hpp). Tensors
// stay channels last between layers; the ops ONNX defines on channels first are wrapped in a
// Transpose pair. A new layer kind adds its emitter here (docs/checkpoints.md lists what each
// kind becomes).
#include <array>
#include <vector>

#include "interop/onnx_export.hpp"
#include "interop/onnx_graph.hpp"
#include "nn/activation.hpp"
#include "nn/average_pooling2d.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/conv2d.hpp"
#include "nn/dense.hpp"
#include "nn/dropout.hpp"
#include "nn/global_average_pooling2d.hpp"
#include "nn/max_pool2d.hpp"
#include "nn/pooling.hpp"
#include "nn/reshape.hpp"

namespace dtrain::interop {
namespace {

// A fused or standalone activation, elementwise (softmax over the last axis, as dtrain's).
std::string activation(std::string_view layer, config::Activation kind, const std::string& x, OnnxGraph& g) {
  switch (kind) {
    case config::Activation::linear: return x;
    case config::Activation::relu: return g.unary(layer, "Relu", x, "relu");
    case config::Activation::sigmoid: return g.unary(layer, "Sigmoid", x, "sigmoid");
    case config::Activation::tanh: return g.unary(layer, "Tanh", x, "tanh");
    case config::Activation::softmax: {
      const std::string y = g.fresh(layer, "softmax");
      set_int(g.node("Softmax", {x}, {y}), "axis", -1);
      return y;
    }
  }
  return x;
}

// Conv2D -> Transpose, Conv (kernel HWIO -> OIHW, bias, strides, SAME's explicit pads), Transpose,
// activation.
std::string conv2d(const nn::Layer& layer, const std::string& x, OnnxGraph& g) {
  const auto& conv = dynamic_cast<const nn::Conv2D&>(layer);
  const nn::Conv2DOptions& o = conv.options();
  const Variable& kernel = conv.variables()[nn::Conv2D::kKernel];
  const Shape& k = kernel.value.shape();  // (kh, kw, in, out)
  const std::vector<float> oihw =
      hwio_to_oihw(std::span<const float>(kernel.value.data<float>(), static_cast<std::size_t>(k.numel())), k[0], k[1],
                   k[2], k[3]);
  const std::array<std::int64_t, 4> dims{k[3], k[2], k[0], k[1]};
  std::vector<std::string> weights{g.initializer(kernel.name, dims, oihw)};
  if (o.use_bias) weights.push_back(g.variable(conv.variables()[nn::Conv2D::kBias]));
  std::string y;
  onnx::NodeProto& node = g.channels_first(layer.name(), "Conv", x, 4, weights, y);
  set_ints(node, "kernel_shape", std::array<std::int64_t, 2>{k[0], k[1]});
  set_ints(node, "strides", std::array<std::int64_t, 2>{o.strides[0], o.strides[1]});
  set_ints(node, "pads", onnx_pads(conv.padding_h(), conv.padding_w()));
  return activation(layer.name(), o.activation, y, g);
}

// Dense -> Gemm (x (N, in) times kernel (in, out) plus bias), activation.
std::string dense(const nn::Layer& layer, const std::string& x, OnnxGraph& g) {
  const auto& d = dynamic_cast<const nn::Dense&>(layer);
  std::vector<std::string> inputs{x, g.variable(d.variables()[nn::Dense::kKernel])};
  if (d.options().use_bias) inputs.push_back(g.variable(d.variables()[nn::Dense::kBias]));
  const std::string y = g.fresh(layer.name(), "gemm");
  g.node("Gemm", inputs, {y});
  return activation(layer.name(), d.options().activation, y, g);
}

// MaxPooling2D / AveragePooling2D -> Transpose, MaxPool / AveragePool (padding excluded from the
// max and from the average, as TensorFlow's SAME), Transpose.
std::string pool(const nn::Layer& layer, const std::string& x, OnnxGraph& g, std::string_view op) {
  const auto& p = dynamic_cast<const nn::Pool2DLayer&>(layer);
  std::string y;
  onnx::NodeProto& node = g.channels_first(layer.name(), op, x, 4, {}, y);
  set_ints(node, "kernel_shape", std::array<std::int64_t, 2>{p.params().pool_size[0], p.params().pool_size[1]});
  set_ints(node, "strides", std::array<std::int64_t, 2>{p.strides()[0], p.strides()[1]});
  set_ints(node, "pads", onnx_pads(p.padding_h(), p.padding_w()));
  if (op == "AveragePool") set_int(node, "count_include_pad", 0);
  return y;
}
std::string max_pool2d(const nn::Layer& layer, const std::string& x, OnnxGraph& g) { return pool(layer, x, g, "MaxPool"); }
std::string average_pooling2d(const nn::Layer& layer, const std::string& x, OnnxGraph& g) {
  return pool(layer, x, g, "AveragePool");
}

// GlobalAveragePooling2D -> Transpose, GlobalAveragePool ((N, C, 1, 1)), Flatten to (N, C).
std::string global_average_pooling2d(const nn::Layer& layer, const std::string& x, OnnxGraph& g) {
  const std::string nchw = g.transpose(layer.name(), x, to_channels_first(4), "to_nchw");
  const std::string pooled = g.unary(layer.name(), "GlobalAveragePool", nchw, "pooled");
  const std::string y = g.fresh(layer.name(), "flatten");
  set_int(g.node("Flatten", {pooled}, {y}), "axis", 1);
  return y;
}

// BatchNormalization -> BatchNormalization in inference form (moving mean and variance, the
// layer's epsilon; gamma ones / beta zeros where the layer has none), on channels first: a
// Transpose pair around it for inputs of rank above 2.
std::string batch_normalization(const nn::Layer& layer, const std::string& x, OnnxGraph& g) {
  const auto& bn = dynamic_cast<const nn::BatchNormalization&>(layer);
  const std::int64_t c = bn.channels();
  const std::array<std::int64_t, 1> dims{c};
  const auto fixed = [&](const char* what, float value) {
    const std::vector<float> values(static_cast<std::size_t>(c), value);
    return g.initializer(g.fresh(layer.name(), what), dims, values);
  };
  const auto vars = bn.variables();
  const std::string gamma = bn.gamma_index() >= 0 ? g.variable(vars[static_cast<std::size_t>(bn.gamma_index())]) : fixed("gamma", 1.0f);
  const std::string beta = bn.beta_index() >= 0 ? g.variable(vars[static_cast<std::size_t>(bn.beta_index())]) : fixed("beta", 0.0f);
  const std::vector<std::string> params{gamma, beta, g.variable(vars[bn.moving_mean_index()]),
                                        g.variable(vars[bn.moving_variance_index()])};
  const std::size_t rank = layer.input_shape().rank() + 1;
  std::string y;
  onnx::NodeProto* node = nullptr;
  if (rank == 2) {
    y = g.fresh(layer.name(), "BatchNormalization");
    std::vector<std::string> inputs{x};
    inputs.insert(inputs.end(), params.begin(), params.end());
    node = &g.node("BatchNormalization", inputs, {y});
  } else {
    node = &g.channels_first(layer.name(), "BatchNormalization", x, rank, params, y);
  }
  set_float(*node, "epsilon", static_cast<float>(bn.options().epsilon));
  return y;
}

// Dropout -> nothing: the identity in inference.
std::string dropout(const nn::Layer&, const std::string& x, OnnxGraph&) { return x; }

// Flatten / Reshape -> Reshape to (N, output shape...): the tensors are channels last, so the
// elements keep dtrain's order.
std::string reshape(const nn::Layer& layer, const std::string& x, OnnxGraph& g) {
  std::vector<std::int64_t> shape{0};  // 0: the input's batch dimension
  for (std::int64_t d : layer.output_shape().dims()) shape.push_back(d);
  const std::string target = g.int64_initializer(g.fresh(layer.name(), "shape"), shape);
  const std::string y = g.fresh(layer.name(), "reshape");
  g.node("Reshape", {x, target}, {y});
  return y;
}

// Activation -> Relu, Sigmoid, Tanh, Softmax (last axis), or nothing for linear.
std::string activation_layer(const nn::Layer& layer, const std::string& x, OnnxGraph& g) {
  return activation(layer.name(), dynamic_cast<const nn::ActivationLayer&>(layer).activation(), x, g);
}

const OnnxEmitterRegistration registered[] = {
    {nn::Conv2DOptions::kind, &conv2d},
    {nn::DenseOptions::kind, &dense},
    {nn::MaxPool2DOptions::kind, &max_pool2d},
    {nn::AveragePooling2DOptions::kind, &average_pooling2d},
    {nn::GlobalAveragePooling2DOptions::kind, &global_average_pooling2d},
    {nn::BatchNormalizationOptions::kind, &batch_normalization},
    {nn::DropoutOptions::kind, &dropout},
    {nn::FlattenOptions::kind, &reshape},
    {nn::ReshapeOptions::kind, &reshape},
    {nn::ActivationOptions::kind, &activation_layer},
};

}  // namespace
}  // namespace dtrain::interop
