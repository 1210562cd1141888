#include "interop/onnx_export.hpp"

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <onnx/checker.h>
#include <onnx/defs/schema.h>
#include <onnx/shape_inference/implementation.h>

#include "core/error.hpp"
#include "dtrain/build_info.hpp"
#include "interop/onnx_graph.hpp"

namespace dtrain::interop {

namespace {

std::map<std::string, OnnxEmitter, std::less<>>& emitters() {
  static std::map<std::string, OnnxEmitter, std::less<>> registry;
  return registry;
}

void set_tensor_type(onnx::ValueInfoProto& value, const std::string& name, const Shape& per_example) {
  value.set_name(name);
  auto* tensor = value.mutable_type()->mutable_tensor_type();
  tensor->set_elem_type(onnx::TensorProto::FLOAT);
  auto* shape = tensor->mutable_shape();
  shape->add_dim()->set_dim_param(kOnnxBatchDim);
  for (std::int64_t d : per_example.dims()) shape->add_dim()->set_dim_value(d);
}

// ONNX's checker and shape inference throw their own exceptions (std::runtime_error and
// derived): a graph they refuse is dtrain's bug, reported with what they said.
template <class F>
void onnx_must_accept(const char* what, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    throw InternalError(fmt::format("the exported ONNX graph fails {}: {}", what, e.what()));
  }
}

}  // namespace

void register_onnx_emitter(std::string_view kind, OnnxEmitter emitter) {
  emitters().emplace(std::string(kind), emitter);
}

std::vector<std::string> onnx_exportable_kinds() {
  std::vector<std::string> kinds;
  for (const auto& [kind, emitter] : emitters()) kinds.push_back(kind);
  return kinds;
}

// ---- OnnxGraph ----

std::string OnnxGraph::fresh(std::string_view layer, std::string_view what) {
  const std::string base = fmt::format("{}/{}", layer, what);
  std::string name = base;
  for (int i = 1; std::find(names_.begin(), names_.end(), name) != names_.end(); ++i) name = fmt::format("{}_{}", base, i);
  names_.push_back(name);
  return name;
}

std::string OnnxGraph::initializer(const std::string& name, std::span<const std::int64_t> dims,
                                   std::span<const float> values) {
  onnx::TensorProto* t = graph_.add_initializer();
  t->set_name(name);
  t->set_data_type(onnx::TensorProto::FLOAT);
  for (std::int64_t d : dims) t->add_dims(d);
  t->set_raw_data(values.data(), values.size_bytes());  // little-endian float32, as ONNX stores raw data
  names_.push_back(name);
  return name;
}

std::string OnnxGraph::variable(const Variable& v) {
  const std::int64_t n = v.value.shape().numel();
  return initializer(v.name, v.value.shape().dims(), std::span<const float>(v.value.data<float>(), static_cast<std::size_t>(n)));
}

std::string OnnxGraph::int64_initializer(const std::string& name, std::span<const std::int64_t> values) {
  onnx::TensorProto* t = graph_.add_initializer();
  t->set_name(name);
  t->set_data_type(onnx::TensorProto::INT64);
  t->add_dims(static_cast<std::int64_t>(values.size()));
  for (std::int64_t v : values) t->add_int64_data(v);
  names_.push_back(name);
  return name;
}

onnx::NodeProto& OnnxGraph::node(std::string_view op, const std::vector<std::string>& inputs,
                                 const std::vector<std::string>& outputs) {
  onnx::NodeProto* n = graph_.add_node();
  n->set_op_type(std::string(op));
  for (const std::string& in : inputs) n->add_input(in);
  for (const std::string& out : outputs) n->add_output(out);
  if (!outputs.empty()) n->set_name(outputs.front());
  return *n;
}

std::string OnnxGraph::transpose(std::string_view layer, const std::string& input, const std::vector<std::int64_t>& perm,
                                 std::string_view what) {
  const std::string out = fresh(layer, what);
  set_ints(node("Transpose", {input}, {out}), "perm", perm);
  return out;
}

std::string OnnxGraph::unary(std::string_view layer, std::string_view op, const std::string& input,
                             std::string_view what) {
  const std::string out = fresh(layer, what);
  node(op, {input}, {out});
  return out;
}

onnx::NodeProto& OnnxGraph::channels_first(std::string_view layer, std::string_view op, const std::string& input,
                                           std::size_t rank, const std::vector<std::string>& more_inputs,
                                           std::string& output) {
  std::vector<std::string> inputs{transpose(layer, input, to_channels_first(rank), "to_nchw")};
  inputs.insert(inputs.end(), more_inputs.begin(), more_inputs.end());
  const std::string computed = fresh(layer, op);
  onnx::NodeProto& n = node(op, inputs, {computed});
  output = transpose(layer, computed, to_channels_last(rank), "to_nhwc");
  return n;
}

void set_ints(onnx::NodeProto& node, const char* name, std::span<const std::int64_t> values) {
  onnx::AttributeProto* a = node.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INTS);
  for (std::int64_t v : values) a->add_ints(v);
}

void set_int(onnx::NodeProto& node, const char* name, std::int64_t value) {
  onnx::AttributeProto* a = node.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(value);
}

void set_float(onnx::NodeProto& node, const char* name, float value) {
  onnx::AttributeProto* a = node.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::FLOAT);
  a->set_f(value);
}

// ---- the arithmetic ----

std::vector<float> hwio_to_oihw(std::span<const float> hwio, std::int64_t kh, std::int64_t kw, std::int64_t in,
                                std::int64_t out) {
  DTRAIN_CHECK(static_cast<std::int64_t>(hwio.size()) == kh * kw * in * out, "conv kernel size does not fit its shape");
  std::vector<float> oihw(hwio.size());
  for (std::int64_t y = 0; y < kh; ++y)
    for (std::int64_t x = 0; x < kw; ++x)
      for (std::int64_t i = 0; i < in; ++i)
        for (std::int64_t o = 0; o < out; ++o)
          oihw[static_cast<std::size_t>(((o * in + i) * kh + y) * kw + x)] =
              hwio[static_cast<std::size_t>(((y * kw + x) * in + i) * out + o)];
  return oihw;
}

std::array<std::int64_t, 4> onnx_pads(const nn::Padding1D& h, const nn::Padding1D& w) {
  return {h.before, w.before, h.after, w.after};
}

std::vector<std::int64_t> to_channels_first(std::size_t rank) {
  std::vector<std::int64_t> perm{0, static_cast<std::int64_t>(rank) - 1};
  for (std::size_t i = 1; i + 1 < rank; ++i) perm.push_back(static_cast<std::int64_t>(i));
  return perm;
}

std::vector<std::int64_t> to_channels_last(std::size_t rank) {
  std::vector<std::int64_t> perm{0};
  for (std::size_t i = 2; i < rank; ++i) perm.push_back(static_cast<std::int64_t>(i));
  perm.push_back(1);
  return perm;
}

// ---- the model ----

std::string export_onnx(std::span<const nn::Layer* const> layers, const Shape& input_shape,
                        const OnnxExportOptions& options) {
  onnx::ModelProto model;
  model.set_ir_version(onnx::IR_VERSION);
  model.set_producer_name("dtrain");
  model.set_producer_version(build_info::version);
  if (!options.doc.empty()) model.set_doc_string(options.doc);
  onnx::OperatorSetIdProto* opset = model.add_opset_import();
  opset->set_domain("");
  opset->set_version(kOnnxOpset);

  onnx::GraphProto& proto = *model.mutable_graph();
  proto.set_name(options.model_name.empty() ? "dtrain" : options.model_name);
  OnnxGraph graph(proto);
  set_tensor_type(*proto.add_input(), kOnnxInputName, input_shape);

  std::string tensor = kOnnxInputName;
  Shape output_shape = input_shape;
  for (const nn::Layer* layer : layers) {
    const auto found = emitters().find(layer->kind());
    if (found == emitters().end())
      throw ConfigError(fmt::format("layer '{}' ({}) has no ONNX conversion, so dtrain export cannot write this model; "
                                    "the kinds it exports are {}",
                                    layer->name(), layer->kind(), fmt::join(onnx_exportable_kinds(), ", ")));
    tensor = found->second(*layer, tensor, graph);
    output_shape = layer->output_shape();
  }
  if (options.softmax) {
    const std::string probabilities = graph.fresh("output", "softmax");
    set_int(graph.node("Softmax", {tensor}, {probabilities}), "axis", -1);
    tensor = probabilities;
  }

  // The last tensor takes the output's name: the node that computes it is renamed, or, for a
  // model whose layers compute nothing in inference, an Identity passes the input on.
  const std::string output = options.softmax ? kOnnxProbabilitiesName : kOnnxLogitsName;
  bool renamed = false;
  for (onnx::NodeProto& n : *proto.mutable_node())
    for (std::string& out : *n.mutable_output())
      if (out == tensor) {
        out = output;
        renamed = true;
      }
  if (!renamed) graph.node("Identity", {tensor}, {output});
  set_tensor_type(*proto.add_output(), output, output_shape);

  onnx_must_accept("ONNX's checker", [&] { onnx::checker::check_model(model); });
  // Strict: a node whose shapes do not infer, or an inferred output shape other than the model's,
  // throws.
  onnx_must_accept("ONNX's shape inference", [&] {
    onnx::shape_inference::InferShapes(model, onnx::OpSchemaRegistry::Instance(),
                                       onnx::ShapeInferenceOptions(/*check_type=*/true, /*strict_mode=*/1));
  });
  onnx_must_accept("ONNX's checker after shape inference", [&] { onnx::checker::check_model(model); });

  std::string bytes;
  if (!model.SerializeToString(&bytes)) throw InternalError("the ONNX model could not be serialized");
  return bytes;
}

std::string export_onnx(const nn::Sequential& model, const OnnxExportOptions& options) {
  std::vector<const nn::Layer*> layers;
  for (std::size_t i = 0; i < model.num_layers(); ++i) layers.push_back(&model.layer(i));
  return export_onnx(layers, model.input_shape(), options);
}

}  // namespace dtrain::interop
