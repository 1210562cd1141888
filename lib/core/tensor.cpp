#include "core/tensor.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include <fmt/format.h>

#include "core/checked.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"

namespace dtrain {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::u8: return 1;
    case DType::i32: return 4;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::u8: return "u8";
    case DType::i32: return "i32";
  }
  return "?";
}

std::string Device::to_string() const { return fmt::format("{}:{}", kind == Kind::cpu ? "cpu" : "gpu", index); }

Shape::Shape(std::initializer_list<std::int64_t> dims) : Shape(std::vector<std::int64_t>(dims)) {}

Shape::Shape(const std::vector<std::int64_t>& dims) : rank_(dims.size()) {
  if (dims.size() > kMaxRank)
    throw InternalError(fmt::format("tensors of rank {} are not supported (at most {})", dims.size(), kMaxRank));
  std::copy(dims.begin(), dims.end(), dims_.begin());
}

std::int64_t Shape::numel() const {
  const auto n = checked_product(dims());
  if (!n) throw ConfigError(fmt::format("a tensor of shape {} has more elements than a 64-bit count holds", to_string()));
  return *n;
}

Shape Shape::tail() const {
  Shape t;
  if (rank_ == 0) return t;
  t.rank_ = rank_ - 1;
  std::copy(dims_.begin() + 1, dims_.begin() + static_cast<std::ptrdiff_t>(rank_), t.dims_.begin());
  return t;
}

Shape Shape::with_batch(std::int64_t n) const {
  if (rank_ + 1 > kMaxRank) throw InternalError("tensor rank too large to add a batch dimension");
  Shape t;
  t.rank_ = rank_ + 1;
  t.dims_[0] = n;
  std::copy(dims_.begin(), dims_.begin() + static_cast<std::ptrdiff_t>(rank_), t.dims_.begin() + 1);
  return t;
}

bool Shape::operator==(const Shape& other) const { return rank_ == other.rank_ && dims_ == other.dims_; }

std::string Shape::to_string() const {
  std::string s = "(";
  for (std::size_t i = 0; i < rank_; ++i) s += fmt::format("{}{}", i ? ", " : "", dims_[i]);
  return s + (rank_ == 1 ? ",)" : ")");
}

Storage::Storage(std::size_t bytes) : bytes_(bytes) {
  std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  data_ = std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded);
  if (!data_) throw std::bad_alloc();
  std::memset(data_, 0, rounded == 0 ? alignment : rounded);
}

Storage::Storage(std::shared_ptr<void> memory, std::size_t bytes, Device device, bool host_accessible)
    : data_(memory.get()),
      backend_memory_(std::move(memory)),
      bytes_(bytes),
      device_(device),
      host_accessible_(host_accessible) {}

Storage::~Storage() {
  if (!backend_memory_) std::free(data_);
}

namespace {

// The bytes of a new tensor, refused before allocating when the machine cannot hold them (an
// allocation that large would fail, or succeed lazily and exhaust memory when first touched).
std::size_t checked_bytes(const Shape& shape, DType dtype) {
  const auto bytes = checked_mul(shape.numel(), static_cast<std::int64_t>(dtype_size(dtype)));
  const MemoryLimit memory = usable_memory();
  if (!bytes || *bytes > memory.bytes)
    throw ConfigError(fmt::format("a tensor of shape {} needs {}, more than {}", shape.to_string(),
                                  bytes ? format_bytes(*bytes) : "more than 8 EB", describe(memory)));
  return static_cast<std::size_t>(*bytes);
}

}  // namespace

Tensor::Tensor(Shape shape, DType dtype)
    : storage_(std::make_shared<Storage>(checked_bytes(shape, dtype))), shape_(std::move(shape)), dtype_(dtype) {}

Tensor::Tensor(Shape shape, DType dtype, std::shared_ptr<Storage> storage)
    : storage_(std::move(storage)), shape_(std::move(shape)), dtype_(dtype), device_(storage_->device()) {
  DTRAIN_CHECK(bytes() <= storage_->bytes(), "a tensor larger than the storage it was given");
}

Tensor Tensor::borrowed(void* host, Shape shape, DType dtype) {
  const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  // The no-op deleter: the memory is the caller's.
  return Tensor(std::move(shape), dtype,
                std::make_shared<Storage>(std::shared_ptr<void>(host, [](void*) {}), bytes, Device{}, true));
}

void Tensor::check_host(std::size_t elem) const {
  DTRAIN_CHECK(storage_ != nullptr, "tensor has no storage");
  DTRAIN_CHECK(elem == dtype_size(dtype_), fmt::format("element size {} does not match dtype {}", elem, dtype_name(dtype_)));
  DTRAIN_CHECK(storage_->host_accessible(),
               fmt::format("a tensor {} in the memory of {}'s backend was read on the host; copy it with the "
                           "context's copy_to_host()", shape_.to_string(), device_.to_string()));
}

Tensor Tensor::reshaped(Shape shape) const {
  DTRAIN_CHECK(shape.numel() == numel(), fmt::format("cannot reshape {} to {}", shape_.to_string(), shape.to_string()));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice_rows(std::int64_t begin, std::int64_t end) const {
  DTRAIN_CHECK(shape_.rank() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "slice out of range");
  Tensor t = *this;
  std::int64_t row = shape_[0] == 0 ? 0 : numel() / shape_[0];
  t.offset_ += static_cast<std::size_t>(begin * row) * dtype_size(dtype_);
  t.shape_[0] = end - begin;
  return t;
}

Tensor Tensor::view(std::int64_t element_offset, Shape shape) const {
  DTRAIN_CHECK(element_offset >= 0 && element_offset + shape.numel() <= numel(),
               fmt::format("view of {} elements at {} outside a tensor of {}", shape.numel(), element_offset, numel()));
  Tensor t = *this;
  t.offset_ += static_cast<std::size_t>(element_offset) * dtype_size(dtype_);
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::clone() const {
  Tensor t(shape_, dtype_);
  check_host(dtype_size(dtype_));
  if (bytes()) std::memcpy(t.raw(), raw(), bytes());
  return t;
}

void Tensor::fill(float value) {
  for (auto& v : span<float>()) v = value;
}

void Tensor::zero() {
  check_host(dtype_size(dtype_));
  if (bytes()) std::memset(raw(), 0, bytes());
}

void Tensor::ensure(const Shape& shape, DType dtype) {
  const std::size_t need = checked_bytes(shape, dtype);
  DTRAIN_CHECK(host_accessible(), "ensure() of a tensor in backend memory");
  if (!storage_ || offset_ + need > storage_->bytes()) {
    *this = Tensor(shape, dtype);
    return;
  }
  shape_ = shape;
  dtype_ = dtype;
}

}  // namespace dtrain
