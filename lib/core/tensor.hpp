// Tensor: a shape, an element type, a device and shared, 64-byte aligned storage.
// Row-major ("canonical") layout: the last dimension is contiguous. Images are channels-last
// (N, H, W, C) as in Keras. Backends may keep blocked copies internally (oneDNN), but every
// Tensor that crosses a module boundary is canonical.
//
// Where the storage lives: host memory (the Tensor(shape) constructor: data read from files,
// staging buffers, what the oracles compute), or memory a backend's context allocated
// (device::Context::tensor(): variables, gradients, optimizer slots, a model's inputs and
// outputs). The host may read backend memory directly only where the backend says it may
// (host_accessible(): the CPU backend, except in its checked mode); elsewhere (a GPU, the checked
// CPU backend) it goes through the context's copies, and data()/span() refuse with an
// InternalError. raw() is the address for the backend's own kernels, never read on the host.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace dtrain {

enum class DType : std::uint8_t { f32, bf16, u8, i32 };
std::size_t dtype_size(DType t);
const char* dtype_name(DType t);

// A device a tensor lives on: the host's CPU (cpu:N, one per replica) or a GPU.
struct Device {
  enum class Kind : std::uint8_t { cpu, gpu };
  Kind kind = Kind::cpu;
  int index = 0;
  bool operator==(const Device&) const = default;
  std::string to_string() const;  // "cpu:0"
};

// Dimensions held inline (rank <= kMaxRank), so copying a Shape or a Tensor view never allocates:
// the training step slices batches into per-replica views every step.
class Shape {
 public:
  static constexpr std::size_t kMaxRank = 8;
  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims);
  explicit Shape(const std::vector<std::int64_t>& dims);

  std::size_t rank() const { return rank_; }
  std::int64_t operator[](std::size_t i) const { return dims_[i]; }
  std::int64_t& operator[](std::size_t i) { return dims_[i]; }
  std::int64_t numel() const;
  std::span<const std::int64_t> dims() const { return {dims_.data(), rank_}; }
  std::vector<std::int64_t> to_vector() const { return {dims_.begin(), dims_.begin() + static_cast<std::ptrdiff_t>(rank_)}; }
  // The shape without its leading (batch) dimension.
  Shape tail() const;
  Shape with_batch(std::int64_t n) const;
  std::string to_string() const;  // "(64, 28, 28, 1)"
  bool operator==(const Shape& other) const;

 private:
  std::array<std::int64_t, kMaxRank> dims_{};  // entries past rank_ stay 0
  std::size_t rank_ = 0;
};

// Owns one allocation: 64-byte aligned host memory, or a backend's memory (released by the
// backend's deleter). Never resized: a Tensor that needs more gets new Storage.
class Storage {
 public:
  static constexpr std::size_t alignment = 64;
  // Zero-filled host memory.
  explicit Storage(std::size_t bytes);
  // `bytes` of backend memory at `memory.get()` (zero-filled by the backend).
  Storage(std::shared_ptr<void> memory, std::size_t bytes, Device device, bool host_accessible);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() { return data_; }
  const void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool host_accessible() const { return host_accessible_; }

 private:
  void* data_ = nullptr;
  std::shared_ptr<void> backend_memory_;  // null for host memory (freed by the destructor)
  std::size_t bytes_ = 0;
  Device device_;
  bool host_accessible_ = true;
};

class Tensor {
 public:
  Tensor() = default;
  // Zero-filled host memory.
  explicit Tensor(Shape shape, DType dtype = DType::f32);
  // Over `storage` (a backend's memory: device::Context::tensor() makes these).
  Tensor(Shape shape, DType dtype, std::shared_ptr<Storage> storage);
  // Over host memory that the caller owns and keeps alive while the tensor is used (tests, and
  // arrays handed in from elsewhere).
  static Tensor borrowed(void* host, Shape shape, DType dtype = DType::f32);

  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  std::int64_t numel() const { return shape_.numel(); }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  bool defined() const { return storage_ != nullptr; }
  // Whether the host may read and write this tensor's memory in place (see the top of the file).
  bool host_accessible() const { return !storage_ || storage_->host_accessible(); }

  // The address, for the backend that owns the memory (or host code, for a host tensor): never
  // dereferenced on the host unless host_accessible().
  void* raw() { return static_cast<char*>(storage_->data()) + offset_; }
  const void* raw() const { return static_cast<const char*>(storage_->data()) + offset_; }
  // raw() typed: what the numerics and kernels are handed.
  template <class T> T* address() { return static_cast<T*>(raw()); }
  template <class T> const T* address() const { return static_cast<const T*>(raw()); }
  // Host access: InternalError unless host_accessible().
  template <class T> T* data() { check_host(sizeof(T)); return static_cast<T*>(raw()); }
  template <class T> const T* data() const { check_host(sizeof(T)); return static_cast<const T*>(raw()); }
  template <class T> std::span<T> span() { return {data<T>(), static_cast<std::size_t>(numel())}; }
  template <class T> std::span<const T> span() const { return {data<T>(), static_cast<std::size_t>(numel())}; }

  // Same storage, another shape with the same element count.
  Tensor reshaped(Shape shape) const;
  // Rows [begin, end) of the leading dimension, sharing storage.
  Tensor slice_rows(std::int64_t begin, std::int64_t end) const;
  // `shape.numel()` elements starting `element_offset` elements in, sharing storage (a model's
  // gradients are views into one contiguous buffer).
  Tensor view(std::int64_t element_offset, Shape shape) const;
  // A deep copy in host memory (of a host-accessible tensor).
  Tensor clone() const;
  // Host writes (of a host-accessible tensor); device::Context::zero() zeroes backend memory.
  void fill(float value);
  void zero();
  // Makes this host tensor hold `shape`, reusing its storage when it is large enough. This is how
  // the training step avoids allocating after the first step of a given shape.
  void ensure(const Shape& shape, DType dtype = DType::f32);

 private:
  void check_host(std::size_t elem) const;
  std::shared_ptr<Storage> storage_;
  std::size_t offset_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
  Device device_;
};

}  // namespace dtrain
