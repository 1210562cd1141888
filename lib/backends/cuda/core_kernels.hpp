// The small kernels around cuDNN and cuBLAS that the conv2d and dense cores launch (on the given
// stream, device pointers, dense row-major arrays): the conv core's input padding, gradient crop,
// filter transpositions and its GEMM path's columns (index arithmetic in conv2d_geometry.hpp,
// tested on the host), and the bias addition both cores share.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "backends/cuda/conv2d_geometry.hpp"
#include "core/tensor.hpp"

namespace dtrain::backends::cuda {

// padded (N, padded_h, padded_w, C) = x (N, H, W, C) with zeros in the appended rows and columns;
// every element of `padded` is written.
void pad_conv_input(const Conv2dGeometry& g, const float* x, float* padded, cudaStream_t stream, Device device);
// dx (N, H, W, C) = the (H, W) corner of padded_dx (N, padded_h, padded_w, C).
void crop_conv_gradient(const Conv2dGeometry& g, const float* padded_dx, float* dx, cudaStream_t stream,
                        Device device);
// ohwi (F, KH, KW, C) = hwio (KH, KW, C, F) transposed, and back.
void hwio_to_ohwi(const Conv2dGeometry& g, const float* hwio, float* ohwi, cudaStream_t stream, Device device);
void ohwi_to_hwio(const Conv2dGeometry& g, const float* ohwi, float* hwio, cudaStream_t stream, Device device);

// The GEMM path's columns (conv2d_geometry.hpp): columns (M, R) of x (N, H, W, C), zeros for the
// padding; and dx (N, H, W, C) = the columns' gradient dcolumns (M, R) summed back, every element
// of dx written.
void conv_columns(const Conv2dGeometry& g, const float* x, float* columns, cudaStream_t stream, Device device);
void conv_columns_gradient(const Conv2dGeometry& g, const float* dcolumns, float* dx, cudaStream_t stream,
                           Device device);

// y (rows, cols) += bias (cols), broadcast over the rows.
void add_bias_rows(float* y, const float* bias, std::int64_t rows, std::int64_t cols, cudaStream_t stream,
                   Device device);
// y (rows, cols) bfloat16 bits = acc + bias (bias null: none), the sum in float32 and then rounded
// as the CPU backend's copies round (core/bfloat16.hpp).
void add_bias_to_bf16(const float* acc, const float* bias, std::uint16_t* y, std::int64_t rows, std::int64_t cols,
                      cudaStream_t stream, Device device);
// The sum over `slices` partial results, slice s at partials + s * stride, added in slice order:
// its first `first_n` elements into `first`, the `second_n` after them into `second` (a kernel
// gradient and its bias's, from one partial layout).
void sum_slices(const float* partials, std::int64_t slices, std::int64_t stride, float* first, std::int64_t first_n,
                float* second, std::int64_t second_n, cudaStream_t stream, Device device);
// partials[s * stride + f] = column f of dy (slices * rows, cols) summed over slice s's rows.
void slice_column_sums(const float* dy, std::int64_t slices, std::int64_t rows, std::int64_t cols, float* partials,
                       std::int64_t stride, cudaStream_t stream, Device device);
// p[0, n) = value.
void fill(float* p, std::int64_t n, float value, cudaStream_t stream, Device device);

}  // namespace dtrain::backends::cuda
