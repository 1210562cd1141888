// The FLOP counts `dtrain bench` divides its timings by, against counts worked out by hand: a
// multiply-add is two operations, a bias and a non-linear activation one per output element.
#include <doctest/doctest.h>

#include "core/rng.hpp"
#include "nn/conv2d.hpp"
#include "nn/dense.hpp"
#include "nn/max_pool2d.hpp"
#include "nn/registry.hpp"

using namespace dtrain;
using config::Activation;
using config::Padding;

namespace {

template <class Options>
nn::Flops flops_of(Options options, const Shape& input) {
  auto layer = nn::make_layer(nn::layer_config("probe", std::move(options)));
  Rng rng(1, RngStream::init, 0);
  layer->build(0, input, rng);
  return layer->flops_per_sample();
}

}  // namespace

TEST_CASE("conv2d FLOPs: the seed CNN's first convolution, by hand") {
  // 3x3 over 28x28x1, valid: 26x26 outputs of 32 filters = 21,632 outputs, each 9 multiply-adds.
  nn::Conv2DOptions o;
  o.filters = 32;
  o.activation = Activation::relu;
  const nn::Flops f = flops_of(o, Shape{28, 28, 1});
  const double outputs = 26 * 26 * 32, macs = outputs * 9;
  CHECK(macs == 194688);
  CHECK(f.forward == 2 * macs + outputs + outputs);  // + bias + relu = 432,640
  CHECK(f.forward == 432640);
  CHECK(f.backward_data == 2 * macs + outputs);      // through relu
  CHECK(f.backward_weights == 2 * macs + outputs);   // + the bias gradient
}

TEST_CASE("conv2d FLOPs: strides, same padding, several input channels, no bias, linear") {
  // 5x5 over 28x28x3, strides 2, same: 14x14 outputs of 8 filters, each 5*5*3 = 75 multiply-adds.
  nn::Conv2DOptions o;
  o.filters = 8;
  o.kernel_size = {5, 5};
  o.strides = {2, 2};
  o.padding = Padding::same;
  o.use_bias = false;
  const nn::Flops f = flops_of(o, Shape{28, 28, 3});
  CHECK(f.forward == 2.0 * 14 * 14 * 8 * 75);  // 235,200
  CHECK(f.backward_data == f.forward);
  CHECK(f.backward_weights == f.forward);
}

TEST_CASE("dense FLOPs, by hand") {
  nn::DenseOptions o;
  o.units = 64;
  o.activation = Activation::relu;
  const nn::Flops f = flops_of(o, Shape{1600});
  CHECK(f.forward == 2.0 * 1600 * 64 + 64 + 64);  // 204,928
  CHECK(f.backward_data == 2.0 * 1600 * 64 + 64);
  CHECK(f.backward_weights == 2.0 * 1600 * 64 + 64);

  nn::DenseOptions logits;
  logits.units = 10;
  logits.use_bias = false;
  const nn::Flops g = flops_of(logits, Shape{64});
  CHECK(g.forward == 1280);
  CHECK(g.backward() == 2560);
}

TEST_CASE("max pooling counts less than the layers with weights and has no weight gradients") {
  nn::MaxPool2DOptions o;
  o.pool_size = {2, 2};
  const nn::Flops f = flops_of(o, Shape{26, 26, 32});
  CHECK(f.forward == 13 * 13 * 32 * 4);  // a compare per window element
  CHECK(f.backward_data == 13 * 13 * 32);
  CHECK(f.backward_weights == 0);
}

TEST_CASE("the seed CNN: 2 x 2,528,000 multiply-adds forward, about 15.2 MFLOP per training sample") {
  // conv 32 (relu) -> pool -> conv 64 (relu) -> pool -> flatten -> dense 64 (relu) -> dense 10.
  nn::Conv2DOptions c1, c2;
  c1.filters = 32;
  c1.activation = Activation::relu;
  c2.filters = 64;
  c2.activation = Activation::relu;
  nn::DenseOptions d1, d2;
  d1.units = 64;
  d1.activation = Activation::relu;
  d2.units = 10;
  const double macs = 26 * 26 * 32 * 9 + 11 * 11 * 64 * 9 * 32 + 1600 * 64 + 64 * 10;
  CHECK(macs == 2528000);
  const nn::Flops a = flops_of(c1, Shape{28, 28, 1}), b = flops_of(c2, Shape{13, 13, 32}),
                  c = flops_of(d1, Shape{1600}), d = flops_of(d2, Shape{64});
  const double forward = a.forward + b.forward + c.forward + d.forward;
  const double elementwise = (26 * 26 * 32 + 11 * 11 * 64 + 64) * 2.0 + 10;  // biases and relus
  CHECK(forward == 2 * macs + elementwise);
  const double training = forward + a.backward() + b.backward() + c.backward() + d.backward();
  CHECK(training / 1e6 == doctest::Approx(15.2).epsilon(0.01));
}
