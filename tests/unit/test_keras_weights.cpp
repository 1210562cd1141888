// interop/keras_weights: the groups Keras 3 names a Sequential's layers by, a weights file written
// and read back, and the files that are refused (a Keras model's own file is read in
// tests/anchors, where Keras is installed).
#include <doctest/doctest.h>
#include <hdf5.h>

#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "core/atomic_file.hpp"
#include "core/error.hpp"
#include "interop/keras_weights.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/conv2d.hpp"
#include "nn/dense.hpp"
#include "nn/max_pool2d.hpp"
#include "nn/registry.hpp"
#include "nn/reshape.hpp"
#include "optim/optimizer.hpp"
#include "test_support.hpp"

using namespace dtrain;

namespace {

// Two layers of a kind (Keras numbers them conv2d, conv2d_1 whatever they are called), one
// without weights between, batch normalization without gamma.
config::ModelConfig keras_model(int units = 4) {
  config::ModelConfig mc;
  mc.input_shape = {8, 8, 1};
  mc.layers = {
      nn::layer_config("first", nn::Conv2DOptions{.filters = 3, .kernel_size = {3, 3}, .kernel_regularizer = {}}),
      nn::layer_config("pool", nn::MaxPool2DOptions{}),
      nn::layer_config("second", nn::Conv2DOptions{.filters = 2, .kernel_size = {2, 2}, .kernel_regularizer = {}}),
      nn::layer_config("bn", nn::BatchNormalizationOptions{.scale = false}),
      nn::layer_config("flat", nn::FlattenOptions{}),
      nn::layer_config("out", nn::DenseOptions{.units = units, .kernel_regularizer = {}}),
  };
  return mc;
}

std::string error_reading(const std::string& path, const nn::Sequential& model) {
  try {
    interop::read_keras_weights(path, model);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("Keras names a layer's group by its class, numbered per class, not by the layer's name") {
  nn::Sequential model(keras_model(), 1, testing::cpu());
  CHECK(interop::keras_layer_groups(model) ==
        std::vector<std::string>{"layers/conv2d", "layers/max_pooling2d", "layers/conv2d_1",
                                 "layers/batch_normalization", "layers/flatten", "layers/dense"});
}

TEST_CASE("a Keras weights file holds every variable in Keras' order and reads back exactly") {
  testing::ScratchDir dir("keras_weights");
  nn::Sequential written(keras_model(), 1, testing::cpu());
  const std::string path = (dir.path() / "m.weights.h5").string();
  write_file_atomically(path, interop::keras_weights_image(written, "probe"));

  // Another seed: every value read must come from the file.
  nn::Sequential read(keras_model(), 2, testing::cpu());
  const std::vector<std::vector<float>> values = interop::read_keras_weights(path, read);
  REQUIRE(values.size() == written.variables().size());
  for (std::size_t v = 0; v < values.size(); ++v) {
    CAPTURE(written.variables()[v]->name);
    const float* expected = written.variables()[v]->value.data<float>();
    CHECK(std::vector<float>(expected, expected + values[v].size()) == values[v]);
  }
  // Batch normalization without gamma keeps beta first: Keras' vars/0 of that layer.
  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  REQUIRE(file >= 0);
  CHECK(H5Lexists(file, "/layers/batch_normalization/vars/2", H5P_DEFAULT) > 0);
  CHECK(H5Lexists(file, "/layers/batch_normalization/vars/3", H5P_DEFAULT) == 0);
  CHECK(H5Lexists(file, "/layers/max_pooling2d/vars", H5P_DEFAULT) > 0);
  CHECK(H5Lexists(file, "/vars", H5P_DEFAULT) > 0);
  H5Fclose(file);
}

TEST_CASE("what is not a Keras weights file of the experiment's model is refused, naming the file and why") {
  testing::ScratchDir dir("keras_weights_refused");
  nn::Sequential model(keras_model(), 1, testing::cpu());
  const std::string missing = (dir.path() / "none.weights.h5").string();
  CHECK(contains(error_reading(missing, model), missing + ": no such file"));
  CHECK(contains(error_reading(dir.path().string(), model), "is not a regular file"));

  const std::string text = (dir.path() / "text.weights.h5").string();
  std::ofstream(text) << "not hdf5\n";
  CHECK(contains(error_reading(text, model), "not an HDF5 file"));

  // A checkpoint: the way to its weights is named.
  const std::string ckpt = (dir.path() / "ckpt-1.h5").string();
  auto optimizer = optim::make_optimizer(config::OptimizerConfig{}, testing::cpu_numerics());
  checkpoint::save(ckpt, model, *optimizer, checkpoint::Contents{});
  const std::string refused = error_reading(ckpt, model);
  CHECK(contains(refused, "is a dtrain checkpoint"));
  CHECK(contains(refused, "--format keras"));

  // Another model's weights: a dense layer of another width, or fewer layers.
  nn::Sequential wider(keras_model(5), 1, testing::cpu());
  const std::string other = (dir.path() / "other.weights.h5").string();
  write_file_atomically(other, interop::keras_weights_image(wider, "wider"));
  const std::string shape = error_reading(other, model);
  CHECK(contains(shape, "/layers/dense/vars/0 has shape (8, 5)"));
  CHECK(contains(shape, "out/kernel of the experiment's layer 'out' (dense) has shape (8, 4)"));

  config::ModelConfig shorter = keras_model();
  shorter.layers.erase(shorter.layers.begin() + 2, shorter.layers.begin() + 4);
  nn::Sequential few(shorter, 1, testing::cpu());
  const std::string few_path = (dir.path() / "few.weights.h5").string();
  write_file_atomically(few_path, interop::keras_weights_image(few, "few"));
  CHECK(contains(error_reading(few_path, model), "layer 'second' (conv2d) has 2 variables, which Keras keeps in "
                                                 "/layers/conv2d_1/vars, but the file holds 0 there"));
  // The reverse: every layer of the experiment fits, but the file has one more with weights.
  config::ModelConfig without_bn = keras_model();
  without_bn.layers.erase(without_bn.layers.begin() + 3);
  nn::Sequential lacking(without_bn, 1, testing::cpu());
  const std::string full = (dir.path() / "full.weights.h5").string();
  write_file_atomically(full, interop::keras_weights_image(model, "full"));
  CHECK(contains(error_reading(full, lacking),
                 "holds weights in /layers/batch_normalization for a layer the experiment's model does not have"));
}
