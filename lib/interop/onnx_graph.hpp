// What an ONNX emitter writes into: the graph under construction, with fresh tensor names,
// initializers from dtrain's variables and nodes with their attributes. Only interop/ includes
// this header (it brings ONNX's protobuf messages).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <onnx/onnx_pb.h>

#include "core/variable.hpp"
#include "nn/layer.hpp"

namespace dtrain::interop {

class OnnxGraph {
 public:
  explicit OnnxGraph(onnx::GraphProto& graph) : graph_(graph) {}

  // A tensor name not used yet: "<layer>/<what>", numbered when taken.
  std::string fresh(std::string_view layer, std::string_view what);

  // A float32 initializer; returns its name.
  std::string initializer(const std::string& name, std::span<const std::int64_t> dims, std::span<const float> values);
  // A variable's values (on the CPU) under its own name ("conv2d/kernel"), or reshaped values.
  std::string variable(const Variable& v);
  // An int64 initializer (Reshape's shape).
  std::string int64_initializer(const std::string& name, std::span<const std::int64_t> values);

  // Adds a node; returns it for attributes. Its name is its first output's.
  onnx::NodeProto& node(std::string_view op, const std::vector<std::string>& inputs,
                        const std::vector<std::string>& outputs);
  // Transpose of `input` by `perm` into a fresh tensor of `layer`; returns its name.
  std::string transpose(std::string_view layer, const std::string& input, const std::vector<std::int64_t>& perm,
                        std::string_view what);
  // One op of one input and one output (Relu, Softmax, ...); returns the output's name.
  std::string unary(std::string_view layer, std::string_view op, const std::string& input, std::string_view what);
  // `op` on a channels-last tensor of `rank` (batch included) as ONNX defines it on channels
  // first: Transpose, the node (its other inputs after the data), Transpose back. Returns the
  // node, for its attributes, and sets `output`.
  onnx::NodeProto& channels_first(std::string_view layer, std::string_view op, const std::string& input,
                                  std::size_t rank, const std::vector<std::string>& more_inputs,
                                  std::string& output);

 private:
  onnx::GraphProto& graph_;
  std::vector<std::string> names_;
};

void set_ints(onnx::NodeProto& node, const char* name, std::span<const std::int64_t> values);
void set_int(onnx::NodeProto& node, const char* name, std::int64_t value);
void set_float(onnx::NodeProto& node, const char* name, float value);

// One layer kind's conversion: appends the layer's nodes reading tensor `input` (channels last,
// (N, layer.input_shape()...)) and returns the name of its output tensor ((N,
// layer.output_shape()...), channels last). A layer that computes nothing in inference returns
// `input`.
using OnnxEmitter = std::string (*)(const nn::Layer& layer, const std::string& input, OnnxGraph& graph);

void register_onnx_emitter(std::string_view kind, OnnxEmitter emitter);

struct OnnxEmitterRegistration {
  OnnxEmitterRegistration(std::string_view kind, OnnxEmitter emitter) { register_onnx_emitter(kind, emitter); }
};

}  // namespace dtrain::interop
