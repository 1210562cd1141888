#include "train/predictions.hpp"

#include <vector>

#include <fmt/format.h>

#include "core/atomic_file.hpp"
#include "core/error.hpp"
#include "core/hdf5.hpp"

namespace dtrain::train {

namespace {

using hdf5::H5Id;

hid_t memory_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return H5T_NATIVE_FLOAT;
    case DType::i32: return H5T_NATIVE_INT32;
    default: throw InternalError(fmt::format("predictions of dtype {} cannot be written", dtype_name(dtype)));
  }
}

}  // namespace

void write_predictions(const std::string& path, const Predictions& p, const std::string& split,
                       const std::string& checkpoint) {
  hdf5::QuietHdf5Errors quiet;
  const auto fail = [&](const std::string& what) {
    return IoError(fmt::format("{}: cannot write the predictions ({}): {}", path, what, hdf5::hdf5_detail()));
  };
  // The file is built in memory (HDF5's core driver, no backing store) and replaced whole.
  H5Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  if (!fapl.valid() || H5Pset_fapl_core(fapl.get(), 1 << 20, 0) < 0) throw fail("file access properties");
  H5Id file(H5Fcreate("predictions.h5", H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
  if (!file.valid()) throw fail("in-memory file");
  const auto dataset = [&](const char* name, const Tensor& t) {
    const std::vector<hsize_t> extent(t.shape().dims().begin(), t.shape().dims().end());
    H5Id space(H5Screate_simple(static_cast<int>(extent.size()), extent.data(), nullptr), H5Sclose);
    const hid_t type = memory_type(t.dtype());
    H5Id ds(H5Dcreate2(file.get(), name, type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
    if (!space.valid() || !ds.valid() || H5Dwrite(ds.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.raw()) < 0)
      throw fail(name);
  };
  dataset("inputs", p.inputs);
  dataset("logits", p.logits);
  dataset("labels", p.labels);
  const auto text = [&](const char* name, const std::string& value) {
    H5Id type(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Id space(H5Screate(H5S_SCALAR), H5Sclose);
    if (!type.valid() || H5Tset_size(type.get(), value.size() + 1) < 0) throw fail(name);
    H5Id attr(H5Acreate2(file.get(), name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    if (!attr.valid() || H5Awrite(attr.get(), type.get(), value.c_str()) < 0) throw fail(name);
  };
  text("split", split);
  text("checkpoint", checkpoint);
  if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) throw fail("flush");
  const ssize_t size = H5Fget_file_image(file.get(), nullptr, 0);
  if (size <= 0) throw fail("file image");
  std::string image(static_cast<std::size_t>(size), '\0');
  if (H5Fget_file_image(file.get(), image.data(), image.size()) != size) throw fail("file image");
  write_file_atomically(path, image);
}

}  // namespace dtrain::train
