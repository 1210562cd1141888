// What the 2-D pooling layers share (MaxPooling2D, AveragePooling2D): Keras' options pool_size,
// strides (default: pool_size) and padding, their YAML schema, and the geometry build() works out.
//   input  x (N, H, W, C)
//   output y (N, OH, OW, C); OH, OW and the padding from nn/padding.hpp
#pragma once

#include <algorithm>
#include <array>
#include <optional>

#include <fmt/format.h>

#include "config/experiment.hpp"
#include "config/schema.hpp"
#include "nn/layer.hpp"
#include "nn/padding.hpp"
#include "nn/reference/layers.hpp"

namespace dtrain::nn {

struct Pool2DParams {
  std::array<int, 2> pool_size{2, 2};
  std::optional<std::array<int, 2>> strides;  // Keras: defaults to pool_size (and stays unset in YAML)
  config::Padding padding = config::Padding::valid;
  bool operator==(const Pool2DParams&) const = default;
};

inline constexpr std::string_view kPool2DKeys[] = {"pool_size", "strides", "padding"};

inline Pool2DParams parse_pool2d(const config::Section& s) {
  Pool2DParams p;
  s.get("pool_size", p.pool_size, config::read_pair);
  if (const config::Node* strides = s.find("strides")) p.strides = config::read_pair(*strides, s.path("strides"));
  s.get_enum("padding", p.padding, "padding", config::padding_names);
  return p;
}

inline void write_pool2d(const Pool2DParams& p, config::OptionsWriter& out) {
  out.pair("pool_size", p.pool_size);
  if (p.strides) out.pair("strides", *p.strides);
  out.enumeration("padding", config::padding_names, p.padding);
}

// A pooling layer's geometry, worked out by build().
class Pool2DLayer : public Layer {
 public:
  Pool2DLayer(std::string name, const Pool2DParams& params)
      : Layer(std::move(name)), params_(params), strides_(params.strides.value_or(params.pool_size)) {}
  const Pool2DParams& params() const { return params_; }
  const std::array<int, 2>& strides() const { return strides_; }
  const Padding1D& padding_h() const { return pad_h_; }
  const Padding1D& padding_w() const { return pad_w_; }
  std::optional<InputExtent> input_extent_read() const override {
    const Shape& in = input_shape();
    const InputExtent read{
        std::min(in[0], (pad_h_.out - 1) * strides_[0] - pad_h_.before + params_.pool_size[0]),
        std::min(in[1], (pad_w_.out - 1) * strides_[1] - pad_w_.before + params_.pool_size[1])};
    if (read.rows == in[0] && read.columns == in[1]) return std::nullopt;
    return read;
  }
  // The reference layers' description of this pooling for `batch` examples.
  reference::PoolDims dims(std::int64_t batch) const {
    const Shape& in = input_shape();
    return {batch,        in[0],        in[1],      in[2],      params_.pool_size[0], params_.pool_size[1],
            strides_[0],  strides_[1],  pad_h_.out, pad_w_.out, pad_h_.before,        pad_w_.before};
  }

 protected:
  Shape build_layer(const Shape& in) override {
    if (in.rank() != 3)
      throw ConfigError(fmt::format("layer '{}': {} needs an input of shape (height, width, channels), got {}", name(),
                                    kind(), in.to_string()));
    pad_h_ = padding_1d(in[0], params_.pool_size[0], strides_[0], params_.padding);
    pad_w_ = padding_1d(in[1], params_.pool_size[1], strides_[1], params_.padding);
    if (pad_h_.out < 1 || pad_w_.out < 1)
      throw ConfigError(fmt::format("layer '{}': pool {}x{} does not fit the input {} with padding valid", name(),
                                    params_.pool_size[0], params_.pool_size[1], in.to_string()));
    return Shape{pad_h_.out, pad_w_.out, in[2]};
  }

 private:
  Pool2DParams params_;
  std::array<int, 2> strides_;
  Padding1D pad_h_, pad_w_;
};

}  // namespace dtrain::nn
