#include <type_traits>

#include "nn/activation_layer.hpp"
#include "nn/conv2d.hpp"
#include "nn/dense.hpp"
#include "nn/flatten.hpp"
#include "nn/max_pool2d.hpp"
#include "nn/model.hpp"

namespace dtrain::nn {

std::unique_ptr<Layer> make_layer(const config::LayerConfig& layer) {
  return std::visit(
      [&](const auto& opt) -> std::unique_ptr<Layer> {
        using T = std::decay_t<decltype(opt)>;
        if constexpr (std::is_same_v<T, config::Conv2DConfig>) return std::make_unique<Conv2D>(layer.name, opt);
        if constexpr (std::is_same_v<T, config::MaxPool2DConfig>) return std::make_unique<MaxPool2D>(layer.name, opt);
        if constexpr (std::is_same_v<T, config::DenseConfig>) return std::make_unique<Dense>(layer.name, opt);
        if constexpr (std::is_same_v<T, config::FlattenConfig>) return std::make_unique<Flatten>(layer.name);
        if constexpr (std::is_same_v<T, config::ReshapeConfig>) return std::make_unique<Reshape>(layer.name, opt);
        if constexpr (std::is_same_v<T, config::ActivationConfig>) return std::make_unique<ActivationLayer>(layer.name, opt);
      },
      layer.options);
}

}  // namespace dtrain::nn
