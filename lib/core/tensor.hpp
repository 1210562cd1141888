// Tensor: a shape, an element type, a device and shared, 64-byte aligned storage.
// Row-major ("canonical") layout: the last dimension is contiguous. Images are channels-last
// (N, H, W, C) as in Keras. Backends may keep blocked copies internally (oneDNN), but every
// Tensor that crosses a module boundary is canonical.
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

// A device a tensor lives on. Only cpu holds data in this release; gpu is named so configs and
// the Strategy layer can already speak of it.
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

// Owns one aligned allocation. Never resized: a Tensor that needs more gets new Storage.
class Storage {
 public:
  static constexpr std::size_t alignment = 64;
  explicit Storage(std::size_t bytes, Device device = {});
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() { return data_; }
  const void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;
  // Allocates zero-filled storage.
  Tensor(Shape shape, DType dtype = DType::f32, Device device = {});

  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  std::int64_t numel() const { return shape_.numel(); }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  bool defined() const { return storage_ != nullptr; }

  void* raw() { return static_cast<char*>(storage_->data()) + offset_; }
  const void* raw() const { return static_cast<const char*>(storage_->data()) + offset_; }
  template <class T> T* data() { check_type(sizeof(T)); return static_cast<T*>(raw()); }
  template <class T> const T* data() const { check_type(sizeof(T)); return static_cast<const T*>(raw()); }
  template <class T> std::span<T> span() { return {data<T>(), static_cast<std::size_t>(numel())}; }
  template <class T> std::span<const T> span() const { return {data<T>(), static_cast<std::size_t>(numel())}; }

  // Same storage, another shape with the same element count.
  Tensor reshaped(Shape shape) const;
  // Rows [begin, end) of the leading dimension, sharing storage.
  Tensor slice_rows(std::int64_t begin, std::int64_t end) const;
  // Elements [first, first + shape.numel()) of this tensor's flat array seen as `shape`, sharing
  // storage: how one contiguous arena holds several tensors.
  Tensor view(std::int64_t first, Shape shape) const;
  // A deep copy.
  Tensor clone() const;
  void fill(float value);
  void zero();
  // Makes this tensor hold `shape`, reusing its storage when it is large enough. This is how
  // the training step avoids allocating after the first step of a given shape.
  void ensure(const Shape& shape, DType dtype = DType::f32);

 private:
  void check_type(std::size_t elem) const;
  std::shared_ptr<Storage> storage_;
  std::size_t offset_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
  Device device_;
};

}  // namespace dtrain
