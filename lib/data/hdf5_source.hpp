// Datasets stored in HDF5: one file, one group per split ("train", "test"), each holding
//   x: (N, ...) integer (values 0..255, stored as u8; a 3-D x gets a channel dimension of 1)
//      or float (stored as f32)
//   y: (N,) integer class labels -> i32, or (N,) / (N, k) float targets -> (N, k) f32
// and optionally an integer attribute num_classes on the group.
#pragma once

#include <string>

#include "data/dataset.hpp"

namespace dtrain::data {

// Every defect (missing file, not HDF5, missing group or dataset, unsupported type, x/y count
// mismatch, labels out of range) is an InputError naming the file and the dataset. HDF5's own
// error printing is silenced while this runs.
Dataset load_hdf5(const std::string& path, const std::string& group);

// The number of examples in /<group>/y (its first dimension), without reading them: what a worker
// needs of the shard files it does not load. Its defects are load_hdf5's InputErrors.
std::int64_t hdf5_rows(const std::string& path, const std::string& group);

}  // namespace dtrain::data
