#include "data/hdf5_source.hpp"

#include <hdf5.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/hdf5.hpp"

namespace dtrain::data {
namespace {

// Far above the datasets dtrain trains on; a larger extent is a corrupt or unintended file.
constexpr std::uint64_t kMaxDatasetBytes = std::uint64_t{16} << 30;

using hdf5::H5Id;
using hdf5::QuietHdf5Errors;
using hdf5::hdf5_detail;

// A value that does not fit the memory type aborts the read instead of being clipped silently.
H5T_conv_ret_t abort_on_overflow(H5T_conv_except_t kind, hid_t, hid_t, void*, void*, void* flag) {
  if (kind == H5T_CONV_EXCEPT_RANGE_HI || kind == H5T_CONV_EXCEPT_RANGE_LOW) {
    *static_cast<bool*>(flag) = true;
    return H5T_CONV_ABORT;
  }
  return H5T_CONV_UNHANDLED;
}

enum class Role { features, targets };

Tensor read_dataset(hid_t file, const std::string& path, const std::string& name, Role role) {
  if (H5Lexists(file, name.c_str(), H5P_DEFAULT) <= 0)
    throw InputError(fmt::format("{}: no dataset {}; each split group needs datasets x and y", path, name));
  H5Id ds(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) throw InputError(fmt::format("{}: {} is not a readable dataset ({})", path, name, hdf5_detail()));
  H5Id space(H5Dget_space(ds.get()), H5Sclose);
  H5Id type(H5Dget_type(ds.get()), H5Tclose);
  if (!space.valid() || !type.valid())
    throw InputError(fmt::format("{}: cannot read the shape or type of {} ({})", path, name, hdf5_detail()));

  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 1 || rank > 8)
    throw InputError(fmt::format("{}: {} has rank {}; expected (N, ...) with at most 8 dimensions", path, name, rank));
  std::vector<hsize_t> extent(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space.get(), extent.data(), nullptr);
  std::vector<std::int64_t> dims(extent.begin(), extent.end());

  const H5T_class_t type_class = H5Tget_class(type.get());
  DType dtype;
  hid_t memory_type;
  if (type_class == H5T_INTEGER) {
    dtype = role == Role::features ? DType::u8 : DType::i32;
    memory_type = role == Role::features ? H5T_NATIVE_UINT8 : H5T_NATIVE_INT32;
  } else if (type_class == H5T_FLOAT) {
    dtype = DType::f32;
    memory_type = H5T_NATIVE_FLOAT;
  } else {
    throw InputError(fmt::format("{}: {} holds neither integers nor floats (HDF5 type class {}); write it as uint8, "
                                 "an integer type or float",
                                 path, name, static_cast<int>(type_class)));
  }

  std::uint64_t bytes = dtype_size(dtype);
  for (auto d : extent) {
    if (d != 0 && bytes > kMaxDatasetBytes / d)
      throw InputError(fmt::format("{}: {} has shape {}, more than {} bytes in memory", path, name,
                                   Shape(dims).to_string(), kMaxDatasetBytes));
    bytes *= d;
  }

  Tensor out = data_tensor(path, name, Shape(dims), dtype);
  if (out.numel() == 0) return out;
  H5Id transfer(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
  bool overflow = false;
  H5Pset_type_conv_cb(transfer.get(), abort_on_overflow, &overflow);
  if (H5Dread(ds.get(), memory_type, H5S_ALL, H5S_ALL, transfer.get(), out.raw()) < 0) {
    if (overflow && dtype == DType::f32)
      throw InputError(fmt::format("{}: {} holds values outside float32's range (or infinite); write finite values "
                                   "that fit float32",
                                   path, name));
    if (overflow)
      throw InputError(fmt::format(
          "{}: {} holds values that do not fit {}; {}", path, name, role == Role::features ? "0..255" : "int32",
          role == Role::features ? "integer x is stored as uint8 images: write real-valued features as float"
                                 : "write class labels as a small integer type"));
    throw InputError(fmt::format("{}: reading {} failed ({})", path, name, hdf5_detail()));
  }
  return out;
}

std::optional<int> read_num_classes(hid_t group, const std::string& path, const std::string& group_name) {
  if (H5Aexists(group, "num_classes") <= 0) return std::nullopt;
  H5Id attr(H5Aopen(group, "num_classes", H5P_DEFAULT), H5Aclose);
  H5Id space(attr.valid() ? H5Aget_space(attr.get()) : -1, H5Sclose);
  H5Id type(attr.valid() ? H5Aget_type(attr.get()) : -1, H5Tclose);
  if (!space.valid() || !type.valid() || H5Tget_class(type.get()) != H5T_INTEGER ||
      H5Sget_simple_extent_npoints(space.get()) != 1)
    throw InputError(fmt::format("{}: attribute num_classes on /{} must be a single integer", path, group_name));
  long long value = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_LLONG, &value) < 0)
    throw InputError(fmt::format("{}: reading attribute num_classes on /{} failed ({})", path, group_name, hdf5_detail()));
  if (value < 1 || value > std::numeric_limits<int>::max())
    throw InputError(fmt::format("{}: attribute num_classes on /{} is {}; it must lie in 1..{} (the number of classes "
                                 "the labels count)",
                                 path, group_name, value, std::numeric_limits<int>::max()));
  return static_cast<int>(value);
}

// The file, checked as load_hdf5 checks it before reading: present, regular, HDF5, with the group.
H5Id open_for_group(const std::string& path, const std::string& group) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw InputError(fmt::format("{}: no such file; data.path and each of data.shards name an HDF5 file with groups "
                                 "/train and /test",
                                 path));
  if (!std::filesystem::is_regular_file(path, ec))
    throw InputError(fmt::format("{}: is not a regular file (a directory, FIFO, socket or device); set data.path to an "
                                 "HDF5 file",
                                 path));
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    throw InputError(fmt::format("{}: not an HDF5 file; data.source hdf5 needs a file with groups /train and /test", path));
  }
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.valid()) throw InputError(fmt::format("{}: cannot open ({})", path, hdf5_detail()));
  if (H5Lexists(file.get(), group.c_str(), H5P_DEFAULT) <= 0)
    throw InputError(fmt::format("{}: no group /{}; the file needs groups /train and /test, each with datasets x and y",
                                 path, group));
  return file;
}

}  // namespace

std::int64_t hdf5_rows(const std::string& path, const std::string& group) {
  QuietHdf5Errors quiet;
  const H5Id file = open_for_group(path, group);
  const std::string y_name = "/" + group + "/y";
  H5Id dataset(H5Lexists(file.get(), y_name.c_str(), H5P_DEFAULT) > 0 ? H5Dopen2(file.get(), y_name.c_str(), H5P_DEFAULT)
                                                                      : -1,
               H5Dclose);
  if (!dataset.valid()) throw InputError(fmt::format("{}: no dataset {} ({})", path, y_name, hdf5_detail()));
  H5Id space(H5Dget_space(dataset.get()), H5Sclose);
  hsize_t dims[H5S_MAX_RANK] = {};
  const int rank = space.valid() ? H5Sget_simple_extent_dims(space.get(), dims, nullptr) : -1;
  if (rank < 1) throw InputError(fmt::format("{}: {} has no first dimension to count its examples by", path, y_name));
  return static_cast<std::int64_t>(dims[0]);
}

Dataset load_hdf5(const std::string& path, const std::string& group) {
  QuietHdf5Errors quiet;
  const H5Id file = open_for_group(path, group);
  H5Id group_id(H5Gopen2(file.get(), group.c_str(), H5P_DEFAULT), H5Gclose);
  if (!group_id.valid()) throw InputError(fmt::format("{}: /{} is not a group ({})", path, group, hdf5_detail()));

  const std::string x_name = "/" + group + "/x";
  const std::string y_name = "/" + group + "/y";
  Tensor x = read_dataset(file.get(), path, x_name, Role::features);
  Tensor y = read_dataset(file.get(), path, y_name, Role::targets);
  check_finite(x, path, x_name);
  check_finite(y, path, y_name);
  if (x.shape()[0] != y.shape()[0])
    throw InputError(fmt::format("{}: {} holds {} examples but {} holds {}; x and y must have the same first dimension",
                                 path, x_name, x.shape()[0], y_name, y.shape()[0]));

  // Images stored as (N, H, W) get the channel dimension the models expect, as IDX files do.
  if (x.dtype() == DType::u8 && x.shape().rank() == 3)
    x = x.reshaped(Shape{x.shape()[0], x.shape()[1], x.shape()[2], 1});

  Dataset ds;
  std::optional<int> declared = read_num_classes(group_id.get(), path, group);
  const std::int64_t n = y.shape()[0];
  if (y.dtype() == DType::i32) {
    if (y.shape().rank() == 2 && y.shape()[1] == 1) y = y.reshaped(Shape{n});
    if (y.shape().rank() != 1)
      throw InputError(fmt::format("{}: {} has shape {}; integer labels must be (N,); write one-hot targets as float",
                                   path, y_name, y.shape().to_string()));
    std::int32_t max_label = -1;
    const auto* labels = y.data<std::int32_t>();
    for (std::int64_t i = 0; i < n; ++i) {
      if (labels[i] < 0 || (declared && labels[i] >= *declared))
        throw InputError(label_out_of_range(fmt::format("{}: {}", path, y_name), labels[i], i, declared.value_or(0)));
      max_label = std::max(max_label, labels[i]);
    }
    ds.num_classes = declared ? *declared : max_label + 1;
    ds.classes_from_labels = !declared;
  } else {
    if (y.shape().rank() == 1) y = y.reshaped(Shape{n, 1});
    if (y.shape().rank() != 2)
      throw InputError(fmt::format("{}: {} has shape {}; float targets must be (N,) or (N, k)", path, y_name,
                                   y.shape().to_string()));
    ds.num_classes = declared ? *declared : static_cast<int>(y.shape()[1]);
  }
  ds.x = x;
  ds.y = y;
  ds.labels_source = fmt::format("{} {}", path, y_name);
  ds.x_scale = x.dtype() == DType::u8 ? 1.0f / 255.0f : 1.0f;
  ds.description = fmt::format("HDF5 /{}: {} examples, x {} {}, from {}", group, n, x.shape().to_string(),
                               dtype_name(x.dtype()), path);
  return ds;
}

}  // namespace dtrain::data
