#include "interop/keras_weights.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include <fmt/format.h>

#include "config/layers.hpp"
#include "core/error.hpp"
#include "core/hdf5.hpp"

namespace dtrain::interop {

namespace fs = std::filesystem;
using hdf5::H5Id;
using hdf5::hdf5_detail;

std::vector<std::string> keras_layer_groups(const nn::Sequential& model) {
  std::map<std::string_view, int> seen;  // Keras' per-class numbering: conv2d, conv2d_1, ...
  std::vector<std::string> groups;
  for (std::size_t i = 0; i < model.num_layers(); ++i) {
    const nn::Layer& layer = model.layer(i);
    const config::LayerSchema* schema = config::find_layer_schema(layer.kind());
    if (!schema || schema->auto_name.empty())
      throw ConfigError(fmt::format("layer '{}' ({}) has no Keras class dtrain knows, so its weights cannot be named "
                                    "in a Keras weights file",
                                    layer.name(), layer.kind()));
    const int n = seen[schema->auto_name]++;
    groups.push_back(n == 0 ? fmt::format("layers/{}", schema->auto_name)
                            : fmt::format("layers/{}_{}", schema->auto_name, n));
  }
  return groups;
}

// ---------------------------------------------------------------- writing

namespace {

class ImageWriter {
 public:
  explicit ImageWriter(const std::string& name) {
    // In memory (HDF5's core driver, nothing written by HDF5 itself): the caller writes the bytes
    // atomically, so a full disk is one line naming the output, never a half-written file.
    H5Id access(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
    if (!access.valid() || H5Pset_fapl_core(access.get(), std::size_t{1} << 20, /*backing_store=*/0) < 0)
      fail("HDF5's in-memory driver");
    file_ = H5Id(H5Fcreate(name.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, access.get()), H5Fclose);
    if (!file_.valid()) fail("the file");
  }

  // A group with Keras' `name` attribute: a variable-length UTF-8 string, as h5py writes a str.
  void named_group(const std::string& path, const std::string& name) {
    H5Id group(H5Gcreate2(file_.get(), path.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    H5Id type(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Id space(H5Screate(H5S_SCALAR), H5Sclose);
    if (!group.valid() || !type.valid() || !space.valid() || H5Tset_size(type.get(), H5T_VARIABLE) < 0 ||
        H5Tset_cset(type.get(), H5T_CSET_UTF8) < 0)
      fail(path);
    H5Id attr(H5Acreate2(group.get(), "name", type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    const char* text = name.c_str();
    if (!attr.valid() || H5Awrite(attr.get(), type.get(), &text) < 0) fail(path + " name");
  }

  void group(const std::string& path) {
    H5Id group(H5Gcreate2(file_.get(), path.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    if (!group.valid()) fail(path);
  }

  // `values`: the variable's values on the host (the context's copy where the host cannot read them).
  void floats(const std::string& path, const Variable& v, const Tensor& values) {
    const std::vector<std::int64_t> dims = v.value.shape().to_vector();
    const std::vector<hsize_t> extent(dims.begin(), dims.end());
    H5Id space(H5Screate_simple(static_cast<int>(extent.size()), extent.data(), nullptr), H5Sclose);
    if (!space.valid()) fail(path);
    H5Id ds(H5Dcreate2(file_.get(), path.c_str(), H5T_IEEE_F32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
            H5Dclose);
    if (!ds.valid() || H5Dwrite(ds.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data<float>()) < 0)
      fail(path);
  }

  std::string image() {
    if (H5Fflush(file_.get(), H5F_SCOPE_GLOBAL) < 0) fail("flush");
    const ssize_t size = H5Fget_file_image(file_.get(), nullptr, 0);
    if (size <= 0) fail("the file image's size");
    std::string bytes(static_cast<std::size_t>(size), '\0');
    if (H5Fget_file_image(file_.get(), bytes.data(), bytes.size()) != size) fail("the file image");
    if (!file_.close()) fail("close");
    return bytes;
  }

 private:
  // Only a broken invariant or memory exhaustion makes an in-memory file fail.
  [[noreturn]] static void fail(const std::string& what) {
    throw InternalError(fmt::format("cannot build the Keras weights file in memory ({}: {})", what, hdf5_detail()));
  }

  hdf5::QuietHdf5Errors quiet_;
  H5Id file_{-1, H5Fclose};
};

}  // namespace

std::string keras_weights_image(const nn::Sequential& model, const std::string& model_name) {
  const std::vector<std::string> groups = keras_layer_groups(model);
  ImageWriter w("keras.weights.h5");
  w.group("/layers");
  for (std::size_t i = 0; i < model.num_layers(); ++i) {
    const nn::Layer& layer = model.layer(i);
    w.group("/" + groups[i]);
    // Keras writes the group of a layer without weights too, with its name.
    w.named_group("/" + groups[i] + "/vars", layer.name());
    for (std::size_t k = 0; k < layer.variables().size(); ++k)
      w.floats(fmt::format("/{}/vars/{}", groups[i], k), layer.variables()[k],
               model.context().on_host(layer.variables()[k].value));
  }
  w.named_group("/vars", model_name.empty() ? "sequential" : model_name);
  return w.image();
}

// ---------------------------------------------------------------- reading

namespace {

class WeightsReader {
 public:
  explicit WeightsReader(const std::string& path) : path_(path) {
    std::error_code ec;
    if (!fs::exists(path, ec))
      fail("no such file; give the weights file Keras wrote with model.save_weights(\"NAME.weights.h5\") or dtrain "
           "export --format keras");
    // A FIFO or device would block the open forever.
    if (!fs::is_regular_file(path, ec))
      fail("is not a regular file (a directory, FIFO, socket or device); give a .weights.h5 file");
    const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
    if (is_hdf5 == 0) fail("not an HDF5 file; Keras 3 writes weights as HDF5 with model.save_weights(\"NAME.weights.h5\")");
    if (is_hdf5 < 0) fail(fmt::format("cannot read it ({})", hdf5_detail()));
    file_ = H5Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (!file_.valid()) fail(fmt::format("cannot open it as HDF5 ({})", hdf5_detail()));
    if (exists("/model") && exists("/state"))
      fail("is a dtrain checkpoint, not a Keras weights file: continue its run with dtrain resume, or write its weights "
           "for Keras with dtrain export CHECKPOINT --format keras -o NAME.weights.h5");
    if (!exists("/layers"))
      fail("has no /layers group, so it is not a Keras 3 weights file (model.save_weights(\"NAME.weights.h5\") writes "
           "one; the Keras 2 layout with /model_weights is not read)");
  }

  bool exists(const std::string& object) const {
    // H5Lexists on a path whose parent is missing fails instead of answering false: walk it.
    std::string prefix;
    for (std::size_t begin = 1; begin <= object.size();) {
      const std::size_t end = std::min(object.find('/', begin), object.size());
      prefix = object.substr(0, end);
      if (H5Lexists(file_.get(), prefix.c_str(), H5P_DEFAULT) <= 0) return false;
      begin = end + 1;
    }
    return true;
  }

  // The names of a group's direct members, in name order (HDF5's iteration by its name index).
  std::vector<std::string> members(const std::string& group) const {
    std::vector<std::string> names;
    const auto collect = [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
      static_cast<std::vector<std::string>*>(out)->emplace_back(name);
      return 0;
    };
    if (H5Literate_by_name(file_.get(), group.c_str(), H5_INDEX_NAME, H5_ITER_INC, nullptr, collect, &names,
                           H5P_DEFAULT) < 0)
      fail(fmt::format("cannot list the group {} ({})", group, hdf5_detail()));
    return names;
  }

  // The dataset at `name` as floats of `variable`'s shape.
  std::vector<float> floats(const std::string& name, const Variable& variable, const nn::Layer& layer) const {
    H5Id ds(H5Dopen2(file_.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
    if (!ds.valid()) fail(fmt::format("{} is not a dataset ({})", name, hdf5_detail()));
    H5Id type(H5Dget_type(ds.get()), H5Tclose);
    H5Id space(H5Dget_space(ds.get()), H5Sclose);
    if (!type.valid() || !space.valid()) fail(fmt::format("cannot read {} ({})", name, hdf5_detail()));
    if (H5Tget_class(type.get()) != H5T_FLOAT || H5Tget_size(type.get()) < 4)
      fail(fmt::format("{} (layer '{}' {}) is not float32 or float64; save the Keras model's weights in float32", name,
                       layer.name(), variable.name));
    const int rank = H5Sget_simple_extent_ndims(space.get());
    std::vector<hsize_t> extent(static_cast<std::size_t>(std::max(rank, 0)));
    if (rank < 0 || H5Sget_simple_extent_dims(space.get(), extent.data(), nullptr) < 0)
      fail(fmt::format("cannot read the shape of {} ({})", name, hdf5_detail()));
    const std::vector<std::int64_t> dims(extent.begin(), extent.end());
    if (dims != variable.value.shape().to_vector())
      fail(fmt::format("{} has shape ({}), but {} of the experiment's layer '{}' ({}) has shape ({}): the file holds "
                       "another model's weights; build the Keras model with the experiment's layers and options",
                       name, fmt::join(dims, ", "), variable.name, layer.name(), layer.kind(),
                       fmt::join(variable.value.shape().to_vector(), ", ")));
    std::vector<float> values(static_cast<std::size_t>(variable.value.numel()));
    if (!values.empty() && H5Dread(ds.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) < 0)
      fail(fmt::format("cannot read {} ({})", name, hdf5_detail()));
    const auto non_finite = std::count_if(values.begin(), values.end(), [](float x) { return !std::isfinite(x); });
    if (non_finite > 0)
      fail(fmt::format("{} ({}) holds {} NaN or infinite values; a model that diverged cannot be trained on", name,
                       variable.name, non_finite));
    return values;
  }

  [[noreturn]] void fail(const std::string& what) const { throw InputError(fmt::format("{}: {}", path_, what)); }

 private:
  hdf5::QuietHdf5Errors quiet_;
  std::string path_;
  H5Id file_{-1, H5Fclose};
};

}  // namespace

std::vector<std::vector<float>> read_keras_weights(const std::string& path, const nn::Sequential& model) {
  const std::vector<std::string> groups = keras_layer_groups(model);
  WeightsReader r(path);
  std::vector<std::vector<float>> values;
  for (std::size_t i = 0; i < model.num_layers(); ++i) {
    const nn::Layer& layer = model.layer(i);
    const std::string vars = "/" + groups[i] + "/vars";
    const std::vector<std::string> stored = r.exists(vars) ? r.members(vars) : std::vector<std::string>{};
    if (stored.size() != layer.variables().size()) {
      const std::vector<std::string> in_file = r.members("/layers");
      r.fail(fmt::format("the experiment's layer '{}' ({}) has {} variables, which Keras keeps in {}, but the file holds "
                         "{} there: the file holds another model's weights (its layers: {}); build the Keras model with "
                         "the experiment's layers in the same order",
                         layer.name(), layer.kind(), layer.variables().size(), vars, stored.size(),
                         fmt::join(in_file, ", ")));
    }
    for (std::size_t k = 0; k < layer.variables().size(); ++k)
      values.push_back(r.floats(fmt::format("{}/{}", vars, k), layer.variables()[k], layer));
  }
  // A layer the experiment lacks: the file's model is another one, even where every group it
  // shares with the experiment fits.
  for (const std::string& member : r.members("/layers")) {
    const std::string group = "layers/" + member;
    if (std::find(groups.begin(), groups.end(), group) != groups.end()) continue;
    const std::string vars = "/" + group + "/vars";
    if (r.exists(vars) && !r.members(vars).empty())
      r.fail(fmt::format("holds weights in /{} for a layer the experiment's model does not have (its layers: {}): the "
                         "file holds another model's weights",
                         group, fmt::join(groups, ", ")));
  }
  return values;
}

}  // namespace dtrain::interop
