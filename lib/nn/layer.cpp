#include "nn/layer.hpp"

namespace dtrain::nn {

std::size_t Layer::add_variable(const std::string& weight, Shape shape) {
  Variable v;
  v.name = name_ + "/" + weight;
  v.value = Tensor(shape);
  v.grad = Tensor(std::move(shape));
  vars_.push_back(std::move(v));
  return vars_.size() - 1;
}

}  // namespace dtrain::nn
