// Small RAII helpers for the HDF5 1.10 C API, shared by the HDF5 data source and the checkpoint
// format.
#pragma once

#include <hdf5.h>

#include <string>

namespace dtrain::hdf5 {

// Closes an HDF5 identifier on scope exit, or explicitly where the close itself can fail.
class H5Id {
 public:
  using Closer = herr_t (*)(hid_t);
  H5Id(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  ~H5Id() { close(); }
  H5Id(const H5Id&) = delete;
  H5Id& operator=(const H5Id&) = delete;
  H5Id(H5Id&& other) noexcept : id_(other.id_), closer_(other.closer_) { other.id_ = -1; }
  H5Id& operator=(H5Id&& other) noexcept {
    if (this != &other) {
      close();
      id_ = other.id_;
      closer_ = other.closer_;
      other.id_ = -1;
    }
    return *this;
  }
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Returns false when HDF5 reports that closing failed (for a file: the final flush failed).
  bool close() {
    if (id_ < 0) return true;
    const herr_t status = closer_(id_);
    id_ = -1;
    return status >= 0;
  }

 private:
  hid_t id_;
  Closer closer_;
};

// HDF5 prints its error stack to stderr by default; dtrain reports its own one-line messages, so
// printing is off while a file is read or written and the previous handler comes back after.
class QuietHdf5Errors {
 public:
  QuietHdf5Errors() {
    H5Eget_auto2(H5E_DEFAULT, &old_func_, &old_data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5Errors() { H5Eset_auto2(H5E_DEFAULT, old_func_, old_data_); }
  QuietHdf5Errors(const QuietHdf5Errors&) = delete;
  QuietHdf5Errors& operator=(const QuietHdf5Errors&) = delete;

 private:
  H5E_auto2_t old_func_ = nullptr;
  void* old_data_ = nullptr;
};

// The innermost message on HDF5's error stack, for the end of our own message.
inline std::string hdf5_detail() {
  std::string detail;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* err, void* out) -> herr_t {
        if (n == 0 && err && err->desc) *static_cast<std::string*>(out) = err->desc;
        return 0;
      },
      &detail);
  H5Eclear2(H5E_DEFAULT);
  return detail.empty() ? "HDF5 reported no detail" : detail;
}

}  // namespace dtrain::hdf5
