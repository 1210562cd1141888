// One thread per element in grid-stride loops, 64-bit indices.
#include "backends/cuda/core_kernels.hpp"

#include "backends/cuda/check.hpp"
#include "backends/cuda/convert.hpp"
#include "backends/cuda/launch.hpp"
#include "backends/cuda/math.hpp"

namespace dtrain::backends::cuda {

namespace {


__global__ void pad_kernel(const float* __restrict__ x, float* __restrict__ padded, std::int64_t total,
                           std::int64_t h, std::int64_t w, std::int64_t c, std::int64_t ph, std::int64_t pw) {
  DTRAIN_GRID_STRIDE(i, total) {
    const std::int64_t from = unpadded_index(i, h, w, c, ph, pw);
    padded[i] = from < 0 ? 0.0f : x[from];
  }
}

__global__ void crop_kernel(const float* __restrict__ padded, float* __restrict__ dx, std::int64_t total,
                            std::int64_t h, std::int64_t w, std::int64_t c, std::int64_t ph, std::int64_t pw) {
  DTRAIN_GRID_STRIDE(i, total) dx[i] = padded[padded_index(i, h, w, c, ph, pw)];
}

// i runs over OHWI; `to_ohwi` chooses the direction (each element is written once either way).
__global__ void transpose_filter_kernel(const float* __restrict__ from, float* __restrict__ to, std::int64_t total,
                                        std::int64_t kh, std::int64_t kw, std::int64_t c, std::int64_t f,
                                        bool to_ohwi) {
  DTRAIN_GRID_STRIDE(i, total) {
    const std::int64_t j = hwio_index(i, kh, kw, c, f);
    if (to_ohwi) to[i] = from[j];
    else to[j] = from[i];
  }
}

__global__ void columns_kernel(const float* __restrict__ x, float* __restrict__ columns, std::int64_t total,
                               ColumnShape s) {
  DTRAIN_GRID_STRIDE(i, total) {
    const std::int64_t from = column_source(i, s);
    columns[i] = from < 0 ? 0.0f : x[from];
  }
}

__global__ void columns_gradient_kernel(const float* __restrict__ dcolumns, float* __restrict__ dx,
                                        std::int64_t total, ColumnShape s) {
  DTRAIN_GRID_STRIDE(i, total) dx[i] = column_gradient_sum(i, dcolumns, s);
}

__global__ void add_bias_kernel(float* __restrict__ y, const float* __restrict__ bias, std::int64_t total,
                                std::int64_t cols) {
  DTRAIN_GRID_STRIDE(i, total) y[i] += bias[i % cols];
}

__global__ void add_bias_to_bf16_kernel(const float* __restrict__ acc, const float* __restrict__ bias,
                                        std::uint16_t* __restrict__ y, std::int64_t total, std::int64_t cols) {
  DTRAIN_GRID_STRIDE(i, total) {
    const float v = bias ? acc[i] + bias[i % cols] : acc[i];
    y[i] = math::bf16_from_f32_bits(__float_as_uint(v));
  }
}

__global__ void sum_slices_kernel(const float* __restrict__ partials, std::int64_t slices, std::int64_t stride,
                                  float* __restrict__ first, std::int64_t first_n, float* __restrict__ second,
                                  std::int64_t second_n) {
  DTRAIN_GRID_STRIDE(i, first_n + second_n) {
    float sum = partials[i];
    for (std::int64_t s = 1; s < slices; ++s) sum += partials[s * stride + i];
    if (i < first_n) first[i] = sum;
    else second[i - first_n] = sum;
  }
}

__global__ void slice_column_sums_kernel(const float* __restrict__ dy, std::int64_t slices, std::int64_t rows,
                                         std::int64_t cols, float* __restrict__ partials, std::int64_t stride) {
  DTRAIN_GRID_STRIDE(i, slices * cols) {
    const std::int64_t s = i / cols, f = i % cols;
    partials[s * stride + f] = column_sum(dy, s * rows, (s + 1) * rows, cols, f);
  }
}

__global__ void fill_kernel(float* __restrict__ p, std::int64_t n, float value) {
  DTRAIN_GRID_STRIDE(i, n) p[i] = value;
}


}  // namespace

void pad_conv_input(const Conv2dGeometry& g, const float* x, float* padded, cudaStream_t stream, Device device) {
  const std::int64_t total = g.padded_x_elements();
  pad_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(x, padded, total, g.h, g.w, g.c, g.padded_h, g.padded_w);
  check_launch("pad_kernel", device);
}

void crop_conv_gradient(const Conv2dGeometry& g, const float* padded_dx, float* dx, cudaStream_t stream,
                        Device device) {
  const std::int64_t total = g.x_elements();
  crop_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(padded_dx, dx, total, g.h, g.w, g.c, g.padded_h, g.padded_w);
  check_launch("crop_kernel", device);
}

void hwio_to_ohwi(const Conv2dGeometry& g, const float* hwio, float* ohwi, cudaStream_t stream, Device device) {
  const std::int64_t total = g.kernel_elements();
  transpose_filter_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(hwio, ohwi, total, g.kh, g.kw, g.c, g.f, true);
  check_launch("transpose_filter_kernel", device);
}

void ohwi_to_hwio(const Conv2dGeometry& g, const float* ohwi, float* hwio, cudaStream_t stream, Device device) {
  const std::int64_t total = g.kernel_elements();
  transpose_filter_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(ohwi, hwio, total, g.kh, g.kw, g.c, g.f, false);
  check_launch("transpose_filter_kernel", device);
}

void conv_columns(const Conv2dGeometry& g, const float* x, float* columns, cudaStream_t stream, Device device) {
  const ColumnShape s = column_shape(g);
  const std::int64_t total = g.n * s.oh * s.ow * s.taps();
  columns_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(x, columns, total, s);
  check_launch("columns_kernel", device);
}

void conv_columns_gradient(const Conv2dGeometry& g, const float* dcolumns, float* dx, cudaStream_t stream,
                           Device device) {
  const std::int64_t total = g.x_elements();
  columns_gradient_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(dcolumns, dx, total, column_shape(g));
  check_launch("columns_gradient_kernel", device);
}

void add_bias_rows(float* y, const float* bias, std::int64_t rows, std::int64_t cols, cudaStream_t stream,
                   Device device) {
  const std::int64_t total = rows * cols;
  if (total == 0) return;
  add_bias_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(y, bias, total, cols);
  check_launch("add_bias_kernel", device);
}

void add_bias_to_bf16(const float* acc, const float* bias, std::uint16_t* y, std::int64_t rows, std::int64_t cols,
                      cudaStream_t stream, Device device) {
  const std::int64_t total = rows * cols;
  if (total == 0) return;
  add_bias_to_bf16_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(acc, bias, y, total, cols);
  check_launch("add_bias_to_bf16_kernel", device);
}

void sum_slices(const float* partials, std::int64_t slices, std::int64_t stride, float* first, std::int64_t first_n,
                float* second, std::int64_t second_n, cudaStream_t stream, Device device) {
  sum_slices_kernel<<<elementwise_blocks(first_n + second_n), kThreads, 0, stream>>>(partials, slices, stride, first,
                                                                                    first_n, second, second_n);
  check_launch("sum_slices_kernel", device);
}

void slice_column_sums(const float* dy, std::int64_t slices, std::int64_t rows, std::int64_t cols, float* partials,
                       std::int64_t stride, cudaStream_t stream, Device device) {
  slice_column_sums_kernel<<<elementwise_blocks(slices * cols), kThreads, 0, stream>>>(dy, slices, rows, cols,
                                                                                      partials, stride);
  check_launch("slice_column_sums_kernel", device);
}

void fill(float* p, std::int64_t n, float value, cudaStream_t stream, Device device) {
  if (n == 0) return;
  fill_kernel<<<elementwise_blocks(n), kThreads, 0, stream>>>(p, n, value);
  check_launch("fill_kernel", device);
}

}  // namespace dtrain::backends::cuda
