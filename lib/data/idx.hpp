// IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed.
//
// Layout: magic = 0x00 0x00 <type code> <rank>, then rank big-endian u32 dimensions, then the
// elements in big-endian row-major order. Type codes read: 0x08 ubyte -> u8; 0x09 byte, 0x0B
// short, 0x0C int -> i32; 0x0D float, 0x0E double -> f32.
#pragma once

#include <string>

#include "core/tensor.hpp"
#include "data/dataset.hpp"

namespace dtrain::data {

// Reads one IDX file; gzip-compressed when the path ends in ".gz". Every defect (missing file,
// bad magic, unknown type code, a header promising more or less data than the file holds, corrupt
// gzip) is an InputError naming the path. Memory grows only with data actually read, so a lying
// header cannot cause a giant allocation.
Tensor read_idx(const std::string& path);

// Loads <dir>/<prefix>-images-idx3-ubyte[.gz] and <dir>/<prefix>-labels-idx1-ubyte[.gz]
// (prefix "train" or "t10k"). x: (N, H, W, 1) u8 (a channel dimension is appended to 3-D image
// files), y: (N,) i32. num_classes > 0 fixes the class count (labels must lie below it);
// 0 takes max label + 1.
Dataset load_idx_split(const std::string& dir, const std::string& prefix, int num_classes = 0);

}  // namespace dtrain::data
