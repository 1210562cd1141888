// `dtrain export`: a trained model in inference mode as an ONNX graph (docs/checkpoints.md,
// "dtrain export"), built with Debian's ONNX library (its protobuf messages, checker and shape
// inference).
//
// The graph keeps dtrain's layout: one input "input" of shape (N, input_shape...) float32,
// channels last (NHWC for images) with a dynamic batch dimension "N", and one output "logits"
// (or "probabilities" with a final Softmax) of shape (N, output_shape...). Every tensor between
// the layers is channels last too, so Flatten and Reshape keep dtrain's element order; the ops
// that ONNX defines on NCHW (Conv, the poolings, BatchNormalization on images) are wrapped in a
// Transpose pair, which ONNX Runtime's optimizer folds away between neighbours.
//
// Each layer kind's conversion is one emitter registered by kind (onnx_layers.cpp), as the
// kernels are; a kind without one is refused (ConfigError, exit 2) naming the layer.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.hpp"
#include "nn/layer.hpp"
#include "nn/model.hpp"
#include "nn/padding.hpp"

namespace dtrain::interop {

// The ONNX operator set the graph imports (ONNX 1.12's newest); the IR version is the library's (8).
inline constexpr int kOnnxOpset = 17;

inline constexpr const char* kOnnxInputName = "input";
inline constexpr const char* kOnnxLogitsName = "logits";
inline constexpr const char* kOnnxProbabilitiesName = "probabilities";
inline constexpr const char* kOnnxBatchDim = "N";

struct OnnxExportOptions {
  bool softmax = false;        // append Softmax over the last axis; the output is then "probabilities"
  std::string model_name;      // the graph's name (the experiment's)
  std::string doc;             // the model's doc_string (where it came from)
};

// The serialized ModelProto of `layers` (in order) on per-example input `input_shape`, after
// onnx::checker::check_model and onnx::shape_inference::InferShapes have accepted it and the
// inferred output shape is the model's. ConfigError naming the layer for a kind without an
// emitter; InternalError when ONNX's checker or shape inference refuses the graph (a dtrain bug).
std::string export_onnx(std::span<const nn::Layer* const> layers, const Shape& input_shape,
                        const OnnxExportOptions& options);
std::string export_onnx(const nn::Sequential& model, const OnnxExportOptions& options);

// The layer kinds an emitter is registered for, sorted (the refusal lists them).
std::vector<std::string> onnx_exportable_kinds();

// ---- the arithmetic the emitters use, exposed for the unit tests ----

// A Keras conv kernel (kh, kw, in, out) row-major, as ONNX Conv's weight (out, in, kh, kw).
std::vector<float> hwio_to_oihw(std::span<const float> hwio, std::int64_t kh, std::int64_t kw, std::int64_t in,
                                std::int64_t out);
// ONNX's `pads` attribute of a 2-D Conv or pooling: (top, left, bottom, right), the explicit
// padding TensorFlow's SAME gives (the odd one at the end) or none for VALID.
std::array<std::int64_t, 4> onnx_pads(const nn::Padding1D& h, const nn::Padding1D& w);
// The permutation of a Transpose from channels last to channels first for a tensor of `rank`
// (batch included): (0, rank-1, 1, ..., rank-2); and its inverse.
std::vector<std::int64_t> to_channels_first(std::size_t rank);
std::vector<std::int64_t> to_channels_last(std::size_t rank);

}  // namespace dtrain::interop
