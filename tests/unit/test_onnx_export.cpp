// dtrain export's pieces that need no ONNX Runtime: the kernel transposition, SAME's pads, the
// Transpose permutations, the graph a model becomes (parsed back with ONNX's own messages) and the
// refusal of a layer kind without an emitter. tests/integration/export.sh runs the graphs.
#include <doctest/doctest.h>

#include <onnx/onnx_pb.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "core/error.hpp"
#include "interop/onnx_export.hpp"
#include "nn/average_pooling2d.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/conv2d.hpp"
#include "nn/dense.hpp"
#include "nn/dropout.hpp"
#include "nn/model.hpp"
#include "nn/registry.hpp"
#include "nn/reshape.hpp"
#include "test_support.hpp"

using namespace dtrain;

TEST_CASE("a Keras conv kernel HWIO becomes ONNX's OIHW") {
  const std::int64_t kh = 2, kw = 3, in = 2, out = 4;
  std::vector<float> hwio(static_cast<std::size_t>(kh * kw * in * out));
  std::iota(hwio.begin(), hwio.end(), 0.0f);
  const std::vector<float> oihw = interop::hwio_to_oihw(hwio, kh, kw, in, out);
  for (std::int64_t y = 0; y < kh; ++y)
    for (std::int64_t x = 0; x < kw; ++x)
      for (std::int64_t i = 0; i < in; ++i)
        for (std::int64_t o = 0; o < out; ++o)
          CHECK(oihw[static_cast<std::size_t>(((o * in + i) * kh + y) * kw + x)] ==
                hwio[static_cast<std::size_t>(((y * kw + x) * in + i) * out + o)]);
  CHECK(oihw[1] == 8.0f);  // (o 0, i 0, y 0, x 1) is HWIO's (0, 1, 0, 0): ((0 * 3 + 1) * 2 + 0) * 4 + 0
}

TEST_CASE("ONNX pads follow TensorFlow's SAME: the odd one at the end; VALID pads nothing") {
  using config::Padding;
  // 28 by a 3-tap window with stride 2: 14 outputs need 29 inputs, so one at the bottom.
  const nn::Padding1D h = nn::padding_1d(28, 3, 2, Padding::same), w = nn::padding_1d(28, 5, 1, Padding::same);
  CHECK(h.out == 14);
  CHECK(interop::onnx_pads(h, w) == std::array<std::int64_t, 4>{0, 2, 1, 2});
  // 6 by 3 with stride 2 and 13 by 2 with stride 2 (the export test's average pooling).
  CHECK(interop::onnx_pads(nn::padding_1d(6, 3, 2, Padding::same), nn::padding_1d(13, 2, 2, Padding::same)) ==
        std::array<std::int64_t, 4>{0, 0, 1, 1});
  // A window larger than what remains pads nothing with VALID (ONNX drops the rest, as TensorFlow).
  CHECK(interop::onnx_pads(nn::padding_1d(7, 2, 2, Padding::valid), nn::padding_1d(5, 3, 1, Padding::valid)) ==
        std::array<std::int64_t, 4>{0, 0, 0, 0});
}

TEST_CASE("the Transposes between channels last and channels first") {
  CHECK(interop::to_channels_first(4) == std::vector<std::int64_t>{0, 3, 1, 2});
  CHECK(interop::to_channels_last(4) == std::vector<std::int64_t>{0, 2, 3, 1});
  CHECK(interop::to_channels_first(3) == std::vector<std::int64_t>{0, 2, 1});
  CHECK(interop::to_channels_last(3) == std::vector<std::int64_t>{0, 2, 1});
}

namespace {

config::ModelConfig exported_model() {
  using config::Activation, config::Padding;
  config::ModelConfig mc;
  mc.input_shape = {9, 8, 2};
  mc.layers = {
      nn::layer_config("conv", nn::Conv2DOptions{.filters = 3, .kernel_size = {3, 2}, .strides = {2, 1},
                                                 .padding = Padding::same, .activation = Activation::relu,
                                                 .kernel_regularizer = {}}),
      nn::layer_config("bn", nn::BatchNormalizationOptions{.epsilon = 0.25, .scale = false}),
      nn::layer_config("pool", nn::AveragePooling2DOptions{{.strides = std::nullopt, .padding = Padding::same}}),
      nn::layer_config("drop", nn::DropoutOptions{0.5}),
      nn::layer_config("flat", nn::FlattenOptions{}),
      nn::layer_config("dense", nn::DenseOptions{.units = 4, .use_bias = false, .kernel_regularizer = {}}),
  };
  return mc;
}

std::vector<std::string> op_types(const onnx::GraphProto& g) {
  std::vector<std::string> ops;
  for (const auto& n : g.node()) ops.push_back(n.op_type());
  return ops;
}

const onnx::AttributeProto* attribute(const onnx::NodeProto& node, const std::string& name) {
  for (const auto& a : node.attribute())
    if (a.name() == name) return &a;
  return nullptr;
}

}  // namespace

TEST_CASE("a model becomes a checked ONNX graph: NHWC input with a dynamic batch, Transpose pairs, no dropout") {
  nn::Sequential model(exported_model(), 5, testing::cpu());
  interop::OnnxExportOptions options;
  options.model_name = "probe";
  onnx::ModelProto m;
  REQUIRE(m.ParseFromString(interop::export_onnx(model, options)));
  CHECK(m.opset_import(0).version() == interop::kOnnxOpset);
  const onnx::GraphProto& g = m.graph();
  CHECK(g.name() == "probe");
  REQUIRE(g.input_size() == 1);
  CHECK(g.input(0).name() == "input");
  const auto& in = g.input(0).type().tensor_type();
  CHECK(in.elem_type() == onnx::TensorProto::FLOAT);
  REQUIRE(in.shape().dim_size() == 4);
  CHECK(in.shape().dim(0).dim_param() == "N");
  CHECK(in.shape().dim(1).dim_value() == 9);
  CHECK(in.shape().dim(3).dim_value() == 2);
  REQUIRE(g.output_size() == 1);
  CHECK(g.output(0).name() == "logits");
  CHECK(g.output(0).type().tensor_type().shape().dim(1).dim_value() == 4);
  CHECK(op_types(g) == std::vector<std::string>{"Transpose", "Conv", "Transpose", "Relu", "Transpose",
                                                "BatchNormalization", "Transpose", "Transpose", "AveragePool",
                                                "Transpose", "Reshape", "Gemm"});
  CHECK(g.node(g.node_size() - 1).output(0) == "logits");
  CHECK(g.node(g.node_size() - 1).input_size() == 2);  // no bias
  // The conv's kernel in OIHW and SAME's pads of 9 rows by 3 with stride 2 (5 outputs: 1 and 1)
  // and of 8 columns by 2 (0 before, 1 after).
  const auto kernel = std::find_if(g.initializer().begin(), g.initializer().end(),
                                   [](const auto& t) { return t.name() == "conv/kernel"; });
  REQUIRE(kernel != g.initializer().end());
  CHECK(std::vector<std::int64_t>(kernel->dims().begin(), kernel->dims().end()) == std::vector<std::int64_t>{3, 2, 3, 2});
  const onnx::AttributeProto* pads = attribute(g.node(1), "pads");
  REQUIRE(pads != nullptr);
  CHECK(std::vector<std::int64_t>(pads->ints().begin(), pads->ints().end()) == std::vector<std::int64_t>{1, 0, 1, 1});
  const onnx::AttributeProto* exclude = attribute(g.node(8), "count_include_pad");
  REQUIRE(exclude != nullptr);
  CHECK(exclude->i() == 0);
  const onnx::AttributeProto* epsilon = attribute(g.node(5), "epsilon");
  REQUIRE(epsilon != nullptr);
  CHECK(epsilon->f() == 0.25f);
  // Shape inference ran: the tensors between the layers carry their shapes.
  CHECK(g.value_info_size() > 0);

  options.softmax = true;
  REQUIRE(m.ParseFromString(interop::export_onnx(model, options)));
  CHECK(m.graph().node(m.graph().node_size() - 1).op_type() == "Softmax");
  CHECK(m.graph().output(0).name() == "probabilities");
}

namespace {
struct ProbeOptions {
  static constexpr std::string_view kind = "onnx_probe";
};
}  // namespace

TEST_CASE("a layer kind without an ONNX emitter is refused, naming the layer") {
  testing::IdentityLayer<ProbeOptions> probe("my_probe", ProbeOptions{});
  probe.declare(0, Shape{4});
  const nn::Layer* layers[] = {&probe};
  CHECK_THROWS_WITH_AS(interop::export_onnx(layers, Shape{4}, {}),
                       doctest::Contains("layer 'my_probe' (onnx_probe) has no ONNX conversion"), ConfigError);
  const std::vector<std::string> kinds = interop::onnx_exportable_kinds();
  for (const char* kind : {"activation", "average_pooling2d", "batch_normalization", "conv2d", "dense", "dropout",
                           "flatten", "global_average_pooling2d", "max_pool2d", "reshape"})
    CHECK(std::find(kinds.begin(), kinds.end(), kind) != kinds.end());
}

TEST_CASE("a model whose layers compute nothing in inference passes its input on") {
  config::ModelConfig mc;
  mc.input_shape = {3};
  mc.layers.push_back(nn::layer_config("drop", nn::DropoutOptions{0.1}));
  nn::Sequential model(mc, 1, testing::cpu());
  onnx::ModelProto m;
  REQUIRE(m.ParseFromString(interop::export_onnx(model, {})));
  CHECK(op_types(m.graph()) == std::vector<std::string>{"Identity"});
  CHECK(m.graph().node(0).input(0) == "input");
  CHECK(m.graph().node(0).output(0) == "logits");
}
