#include "backends/onednn/checked_memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string_view>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::backends::onednn {

namespace {

std::size_t page_rounded(std::size_t bytes) {
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return (std::max<std::size_t>(bytes, 1) + page - 1) / page * page;
}

void set_protection(const char* p, std::size_t bytes, bool accessible) {
  if (mprotect(const_cast<char*>(p), bytes, accessible ? PROT_READ | PROT_WRITE : PROT_NONE) != 0)
    throw InternalError(fmt::format("checked memory: mprotect failed ({})", std::strerror(errno)));
}

}  // namespace

bool CheckedMemory::requested() {
  const char* v = std::getenv("DTRAIN_CHECKED_MEMORY");
  return v != nullptr && std::string_view(v) == "1";
}

device::Buffer CheckedMemory::allocate(std::size_t bytes) {
  const std::size_t mapped = page_rounded(bytes);
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  std::lock_guard lock(state_->mutex);
  // Outside a call the new pages are closed at once; inside one they close when it ends.
  if (state_->depth == 0) set_protection(static_cast<const char*>(p), mapped, false);
  state_->buffers.emplace(static_cast<const char*>(p), mapped);
  return device::Buffer(p, [state = state_, mapped](void* q) {
    {
      std::lock_guard lock(state->mutex);
      state->buffers.erase(static_cast<const char*>(q));
    }
    munmap(q, mapped);
  });
}

void CheckedMemory::enter() {
  std::lock_guard lock(state_->mutex);
  if (state_->depth++ == 0)
    for (const auto& [p, bytes] : state_->buffers) set_protection(p, bytes, true);
}

void CheckedMemory::leave() {
  std::lock_guard lock(state_->mutex);
  if (--state_->depth == 0)
    for (const auto& [p, bytes] : state_->buffers) set_protection(p, bytes, false);
}

bool CheckedMemory::owns(const void* p, std::size_t bytes) const {
  const auto* c = static_cast<const char*>(p);
  std::lock_guard lock(state_->mutex);
  auto it = state_->buffers.upper_bound(c);
  if (it == state_->buffers.begin()) return false;
  --it;
  return c >= it->first && c + bytes <= it->first + it->second;
}

namespace {

class CheckedNumerics final : public device::Numerics {
 public:
  CheckedNumerics(device::Numerics& inner, CheckedMemory& memory, device::Context& ctx)
      : inner_(inner), memory_(memory), ctx_(ctx) {}

  void sgd_update(const device::SgdStep& step, float* w, const float* g, float* momentum, std::size_t n) override {
    device::Context::Call call(ctx_);
    mine(w, n, "sgd weights");
    mine(g, n, "sgd gradients");
    if (momentum) mine(momentum, n, "sgd momentum");
    inner_.sgd_update(step, w, g, momentum, n);
  }
  void adam_update(const device::AdamStep& step, float* w, const float* g, float* m, float* v, std::size_t n) override {
    device::Context::Call call(ctx_);
    mine(w, n, "adam weights");
    mine(g, n, "adam gradients");
    mine(m, n, "adam m");
    mine(v, n, "adam v");
    inner_.adam_update(step, w, g, m, v, n);
  }
  void rmsprop_update(const device::RmspropStep& step, float* w, const float* g, float* velocity, float* momentum,
                      float* average, std::size_t n) override {
    device::Context::Call call(ctx_);
    mine(w, n, "rmsprop weights");
    mine(g, n, "rmsprop gradients");
    mine(velocity, n, "rmsprop velocity");
    if (momentum) mine(momentum, n, "rmsprop momentum");
    if (average) mine(average, n, "rmsprop average");
    inner_.rmsprop_update(step, w, g, velocity, momentum, average, n);
  }
  void loss(const device::LossBatch& b) override {
    device::Context::Call call(ctx_);
    const auto cells = static_cast<std::size_t>(b.rows * b.columns);
    const auto rows = static_cast<std::size_t>(b.rows);
    mine(b.pred, cells, "loss predictions");
    if (b.dense_targets) mine(b.dense_targets, cells, "loss targets");
    if (b.labels) mine(b.labels, rows, "loss labels");
    if (b.weights) mine(b.weights, rows, "loss sample weights");
    if (b.grad) mine(b.grad, cells, "loss gradient");
    inner_.loss(b);
  }
  void argmax_rows(const float* values, std::int64_t rows, std::int64_t columns, std::int32_t* out) override {
    device::Context::Call call(ctx_);
    mine(values, static_cast<std::size_t>(rows * columns), "argmax values");
    inner_.argmax_rows(values, rows, columns, out);
  }
  void row_matches(const float* pred, const void* targets, bool targets_are_i32, std::int64_t rows,
                   std::int64_t columns, const float* threshold, std::int64_t* matches) override {
    device::Context::Call call(ctx_);
    const auto cells = static_cast<std::size_t>(rows * columns);
    mine(pred, cells, "metric predictions");
    mine(static_cast<const char*>(targets), cells * 4, "metric targets");
    inner_.row_matches(pred, targets, targets_are_i32, rows, columns, threshold, matches);
  }
  void to_host(const void* src, void* host, std::size_t bytes) override {
    device::Context::Call call(ctx_);
    mine(static_cast<const char*>(src), bytes, "read-back source");
    inner_.to_host(src, host, bytes);
  }
  double sum_of_squares(const float* x, std::size_t n) override {
    device::Context::Call call(ctx_);
    mine(x, n, "regularized variable");
    return inner_.sum_of_squares(x, n);
  }
  void axpy(float a, const float* x, float* y, std::size_t n) override {
    device::Context::Call call(ctx_);
    mine(x, n, "axpy x");
    mine(y, n, "axpy y");
    inner_.axpy(a, x, y, n);
  }
  void axpby(float a, const float* x, float b, float* y, std::size_t n) override {
    device::Context::Call call(ctx_);
    mine(x, n, "axpby x");
    mine(y, n, "axpby y");
    inner_.axpby(a, x, b, y, n);
  }

 private:
  // A pointer the device loops read or write must be the context's memory: on a GPU anything else
  // faults (or reads garbage), so here it is an error that names the argument.
  template <class T>
  void mine(const T* p, std::size_t count, const char* what) const {
    if (count == 0) return;
    if (!memory_.owns(p, count * sizeof(T)))
      throw InternalError(fmt::format("checked memory: the {} handed to the {} backend's numerics are not its memory "
                                      "(host memory must be staged with the context's copies first)",
                                      what, ctx_.device().to_string()));
  }

  device::Numerics& inner_;
  CheckedMemory& memory_;
  device::Context& ctx_;
};

}  // namespace

std::unique_ptr<device::Numerics> checked_numerics(device::Numerics& inner, CheckedMemory& memory,
                                                   device::Context& ctx) {
  return std::make_unique<CheckedNumerics>(inner, memory, ctx);
}

}  // namespace dtrain::backends::onednn
