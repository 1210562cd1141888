// The HDF5 checkpoint format (layout in checkpoint.hpp).
//
// Reading is two-phase: everything is read and verified into plain byte buffers first, and only
// then copied into the model and optimizer, so a bad file never leaves them half-restored.
#include "checkpoint/checkpoint.hpp"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/atomic_file.hpp"
#include "core/error.hpp"
#include "core/hdf5.hpp"

namespace dtrain::checkpoint {

std::string position_in_training(const TrainingState& state) {
  return state.step_in_epoch == 0 ? fmt::format("after epoch {}", state.epoch)
                                  : fmt::format("epoch {}, step {} of it", state.epoch + 1, state.step_in_epoch);
}
namespace {

using hdf5::H5Id;
using hdf5::QuietHdf5Errors;
using hdf5::hdf5_detail;

namespace fs = std::filesystem;

// The crc32 attribute covers the bytes as stored; dtrain stores little-endian types and computes
// the checksum over its in-memory copy, which is the same bytes only on a little-endian host.
static_assert(std::endian::native == std::endian::little, "checkpoint checksums assume a little-endian host");

std::uint32_t crc32_of(const void* data, std::size_t bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  // zlib takes uInt lengths; feed large buffers in pieces.
  constexpr std::size_t kChunk = std::size_t{1} << 30;
  while (bytes > 0) {
    const std::size_t n = std::min(bytes, kChunk);
    crc = crc32(crc, p, static_cast<uInt>(n));
    p += n;
    bytes -= n;
  }
  return static_cast<std::uint32_t>(crc);
}

// "(1600, 64)", "(64,)", "()": the same spelling as Shape::to_string, for any rank.
std::string format_dims(const std::vector<std::int64_t>& dims) {
  std::string s = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

std::string model_dataset(const std::string& variable) { return "/model/" + variable; }
std::string slot_dataset(const std::string& slot, const std::string& variable) {
  return "/optimizer/" + slot + "/" + variable;
}

// Variable names become HDF5 paths; an empty component would silently merge or misplace groups.
void check_variable_name(const std::string& name) {
  bool ok = !name.empty() && name.front() != '/' && name.back() != '/' && name.find("//") == std::string::npos;
  DTRAIN_CHECK(ok, fmt::format("variable name '{}' cannot be stored in a checkpoint: it must be '<layer>/<weight>'",
                               name));
}

// ---------------------------------------------------------------- writing

class Writer {
 public:
  Writer(hid_t file, const std::string& path) : file_(file), path_(path) {
    if (!link_props_.valid() || H5Pset_create_intermediate_group(link_props_.get(), 1) < 0) fail("link properties");
  }

  // A contiguous dataset (scalar when dims is empty) with its crc32 attribute.
  void dataset(const std::string& name, hid_t file_type, hid_t memory_type, const std::vector<std::int64_t>& dims,
               const void* data, std::size_t bytes) {
    std::vector<hsize_t> extent(dims.begin(), dims.end());
    H5Id space(dims.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(static_cast<int>(extent.size()), extent.data(), nullptr),
               H5Sclose);
    if (!space.valid()) fail(name);
    H5Id ds(H5Dcreate2(file_, name.c_str(), file_type, space.get(), link_props_.get(), H5P_DEFAULT, H5P_DEFAULT),
            H5Dclose);
    if (!ds.valid()) fail(name);
    if (bytes > 0 && H5Dwrite(ds.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) fail(name);
    const std::uint32_t crc = crc32_of(data, bytes);
    attribute(ds.get(), name, "crc32", H5T_STD_U32LE, H5T_NATIVE_UINT32, &crc);
  }

  void floats(const std::string& name, const Tensor& t) {
    DTRAIN_CHECK(t.defined() && t.dtype() == DType::f32,
                 fmt::format("checkpoint dataset {} must be an f32 tensor", name));
    dataset(name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, t.shape().to_vector(), t.raw(), t.bytes());
  }
  void zero_floats(const std::string& name, const Shape& shape) {
    std::vector<float> zeros(static_cast<std::size_t>(shape.numel()), 0.0f);
    dataset(name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, shape.to_vector(), zeros.data(), zeros.size() * sizeof(float));
  }
  void scalar_i64(const std::string& name, std::int64_t v) {
    dataset(name, H5T_STD_I64LE, H5T_NATIVE_INT64, {}, &v, sizeof v);
  }
  void scalar_u64(const std::string& name, std::uint64_t v) {
    dataset(name, H5T_STD_U64LE, H5T_NATIVE_UINT64, {}, &v, sizeof v);
  }
  void scalar_f64(const std::string& name, double v) {
    dataset(name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, {}, &v, sizeof v);
  }
  void vector_i64(const std::string& name, const std::vector<std::int64_t>& v) {
    dataset(name, H5T_STD_I64LE, H5T_NATIVE_INT64, {static_cast<std::int64_t>(v.size())}, v.data(),
            v.size() * sizeof(std::int64_t));
  }
  void vector_f64(const std::string& name, const std::vector<double>& v) {
    dataset(name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, {static_cast<std::int64_t>(v.size())}, v.data(),
            v.size() * sizeof(double));
  }
  // A fixed-length, NUL-padded scalar string: h5dump prints it as text. HDF5 refuses size 0, so
  // an empty string is stored as one NUL.
  void string_dataset(const std::string& name, const std::string& value) {
    H5Id type(string_type(value.size()), H5Tclose);
    H5Id space(H5Screate(H5S_SCALAR), H5Sclose);
    if (!type.valid() || !space.valid()) fail(name);
    H5Id ds(H5Dcreate2(file_, name.c_str(), type.get(), space.get(), link_props_.get(), H5P_DEFAULT, H5P_DEFAULT),
            H5Dclose);
    if (!ds.valid()) fail(name);
    std::string stored = value.empty() ? std::string(1, '\0') : value;
    if (H5Dwrite(ds.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, stored.data()) < 0) fail(name);
    const std::uint32_t crc = crc32_of(stored.data(), stored.size());
    attribute(ds.get(), name, "crc32", H5T_STD_U32LE, H5T_NATIVE_UINT32, &crc);
  }

  H5Id group(const std::string& name) {
    H5Id g(H5Gcreate2(file_, name.c_str(), link_props_.get(), H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    if (!g.valid()) fail(name);
    return g;
  }

  void attribute(hid_t object, const std::string& object_name, const char* attr_name, hid_t file_type,
                 hid_t memory_type, const void* value) {
    H5Id space(H5Screate(H5S_SCALAR), H5Sclose);
    H5Id attr(space.valid() ? H5Acreate2(object, attr_name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT) : -1,
              H5Aclose);
    if (!attr.valid() || H5Awrite(attr.get(), memory_type, value) < 0)
      fail(fmt::format("attribute {} of {}", attr_name, object_name));
  }
  void string_attribute(hid_t object, const std::string& object_name, const char* attr_name, const std::string& value) {
    H5Id type(string_type(value.size()), H5Tclose);
    if (!type.valid()) fail(fmt::format("attribute {} of {}", attr_name, object_name));
    std::string stored = value.empty() ? std::string(1, '\0') : value;
    attribute(object, object_name, attr_name, type.get(), type.get(), stored.data());
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw IoError(fmt::format("{}: cannot write the checkpoint ({}: {}); check that the directory is writable and has "
                              "free space",
                              path_, what, hdf5_detail()));
  }

 private:
  static hid_t string_type(std::size_t length) {
    hid_t type = H5Tcopy(H5T_C_S1);
    if (type < 0) return type;
    // UTF-8 because YAML may hold any text; h5py then reads it back as str.
    if (H5Tset_size(type, std::max<std::size_t>(length, 1)) < 0 || H5Tset_strpad(type, H5T_STR_NULLPAD) < 0 ||
        H5Tset_cset(type, H5T_CSET_UTF8) < 0) {
      H5Tclose(type);
      return -1;
    }
    return type;
  }

  hid_t file_;
  const std::string& path_;
  H5Id link_props_{H5Pcreate(H5P_LINK_CREATE), H5Pclose};
};

// The checkpoint's HDF5 image, built in memory (HDF5's core driver, no backing store): HDF5 never
// writes to the disk itself, so a full or read-only disk is an error of dtrain's own write(2) (one
// line naming the path) rather than an HDF5 stack dump and a file HDF5 cannot close at exit. The
// image has no user block; the seal is put in front of it when it is written, and HDF5 finds its
// superblock at byte 512 as it does in any file with a user block.
std::string checkpoint_image(const std::string& path, const nn::Sequential& model, const optim::Optimizer& optimizer,
                             const Contents& contents) {
  const TrainingState& state = contents.state;
  DTRAIN_CHECK(state.metric_counts.size() == state.metric_sums.size(),
               fmt::format("training state has counts for {} metrics but sums for {}", state.metric_counts.size(),
                           state.metric_sums.size()));
  const auto& vars = model.variables();
  // The optimizer has slots for the trainable variables only (moving statistics have none).
  const auto& trained = model.trainable_variables();
  const std::vector<std::string> slot_names = optimizer.slot_names();
  DTRAIN_CHECK(!optimizer.built() || optimizer.num_variables() == trained.size(),
               fmt::format("optimizer {} tracks {} variables but the model has {} trainable ones", optimizer.name(),
                           optimizer.num_variables(), trained.size()));
  for (const Variable* v : vars) check_variable_name(v->name);

  // The default (oldest) file format on purpose: the 1.8 format's metadata checksums made HDF5
  // 1.10 leak the file on a corrupt header and complain at process exit; dtrain's own crc32 per
  // dataset and its shape checks already catch what a corrupt header would misread.
  H5Id access(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  if (!access.valid() || H5Pset_fapl_core(access.get(), std::size_t{1} << 20, /*backing_store=*/0) < 0)
    throw InternalError(fmt::format("cannot set up HDF5's in-memory driver ({})", hdf5_detail()));
  H5Id file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, access.get()), H5Fclose);
  if (!file.valid())
    throw InternalError(fmt::format("{}: cannot create the checkpoint image in memory ({})", path, hdf5_detail()));
  Writer w(file.get(), path);

  const int version = kFormatVersion;
  w.attribute(file.get(), "/", "format_version", H5T_STD_I32LE, H5T_NATIVE_INT, &version);
  w.string_attribute(file.get(), "/", "dtrain_version", contents.dtrain_version);
  w.string_attribute(file.get(), "/", "created_by", "dtrain");

  w.group("/model");
  // Read through the model's context: the values may be device memory.
  device::Context& ctx = model.context();
  for (const Variable* v : vars) w.floats(model_dataset(v->name), ctx.on_host(v->value));

  {
    H5Id group = w.group("/optimizer");
    w.string_attribute(group.get(), "/optimizer", "name", optimizer.name());
    const std::int64_t iterations = optimizer.iterations();
    w.attribute(group.get(), "/optimizer", "iterations", H5T_STD_I64LE, H5T_NATIVE_INT64, &iterations);
  }
  for (std::size_t s = 0; s < slot_names.size(); ++s) {
    for (std::size_t i = 0; i < trained.size(); ++i) {
      const std::string name = slot_dataset(slot_names[s], trained[i]->name);
      // An optimizer that has not stepped yet has the zero slots build() would create.
      if (optimizer.built()) {
        const Tensor& slot = optimizer.slot(i, s);
        DTRAIN_CHECK(slot.shape() == trained[i]->value.shape(),
                     fmt::format("optimizer slot {} has shape {}, its variable {}", name, slot.shape().to_string(),
                                 trained[i]->value.shape().to_string()));
        w.floats(name, ctx.on_host(slot));
      } else {
        w.zero_floats(name, trained[i]->value.shape());
      }
    }
  }

  w.group("/state");
  w.scalar_i64("/state/epoch", state.epoch);
  w.scalar_i64("/state/step_in_epoch", state.step_in_epoch);
  w.scalar_i64("/state/global_step", state.global_step);
  w.scalar_u64("/state/seed", state.seed);
  w.scalar_f64("/state/epoch_loss_sum", state.epoch_loss_sum);
  w.scalar_i64("/state/epoch_samples", state.epoch_samples);
  w.scalar_i64("/state/replicas_in_sync", state.replicas_in_sync);
  w.scalar_i64("/state/workers", state.workers);
  w.scalar_i64("/state/global_batch", state.global_batch);
  w.group("/state/metrics");
  for (std::size_t m = 0; m < state.metric_counts.size(); ++m) {
    w.vector_i64(fmt::format("/state/metrics/{}/counts", m), state.metric_counts[m]);
    w.vector_f64(fmt::format("/state/metrics/{}/sums", m), state.metric_sums[m]);
  }

  w.string_dataset("/experiment", contents.experiment_yaml);

  if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) w.fail("flush");
  const ssize_t size = H5Fget_file_image(file.get(), nullptr, 0);
  if (size <= 0) w.fail("file image size");
  std::string image(static_cast<std::size_t>(size), '\0');
  if (H5Fget_file_image(file.get(), image.data(), image.size()) != size) w.fail("file image");
  if (!file.close()) w.fail("close");
  return image;
}

[[noreturn]] void throw_errno(const std::string& path, const std::string& what) {
  throw IoError(fmt::format("{}: {} failed ({}); check the disk and the directory's permissions", path, what,
                            std::strerror(errno)));
}

// The whole-file checksum in the user block: magic, version, then little-endian u64 length and u32
// crc32 of the bytes after the block, the rest zero.
constexpr char kSealMagic[8] = {'D', 'T', 'R', 'A', 'I', 'N', 'C', 'K'};
constexpr std::uint32_t kSealVersion = 1;

struct SealInfo {
  std::uint64_t length = 0;
  std::uint32_t crc = 0;
};

// crc32 and length of everything from offset kSealBytes to the end of the open file.
SealInfo checksum_after_block(int fd, const std::string& path) {
  SealInfo info;
  uLong crc = crc32(0L, Z_NULL, 0);
  std::vector<unsigned char> buffer(std::size_t{1} << 20);
  auto offset = static_cast<off_t>(kSealBytes);
  for (;;) {
    const ssize_t n = ::pread(fd, buffer.data(), buffer.size(), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_errno(path, "reading the checkpoint to checksum it");
    if (n == 0) break;
    crc = crc32(crc, buffer.data(), static_cast<uInt>(n));
    offset += n;
    info.length += static_cast<std::uint64_t>(n);
  }
  info.crc = static_cast<std::uint32_t>(crc);
  return info;
}

// The seal (the user block: magic, version, length and crc32 of the image) followed by `image`.
std::string sealed(const std::string& image) {
  std::string file(kSealBytes, '\0');
  const std::uint64_t length = image.size();
  const std::uint32_t crc = crc32_of(image.data(), image.size());
  std::memcpy(file.data(), kSealMagic, sizeof kSealMagic);
  std::memcpy(file.data() + 8, &kSealVersion, 4);
  std::memcpy(file.data() + 12, &length, 8);
  std::memcpy(file.data() + 20, &crc, 4);
  return file + image;
}

}  // namespace

std::optional<bool> verify_seal(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;  // the reader reports missing or unreadable files itself
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  unsigned char block[24] = {};
  if (::pread(fd, block, sizeof block, 0) != static_cast<ssize_t>(sizeof block)) return std::nullopt;
  if (std::memcmp(block, kSealMagic, sizeof kSealMagic) != 0) {
    // Unsealed is only what an older dtrain wrote: HDF5's signature at byte 0, no user block.
    // Anything else (one flipped bit in the magic, a foreign user block) cannot be trusted, or one
    // damaged byte would switch the whole-file check off.
    constexpr unsigned char kHdf5Signature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
    if (std::memcmp(block, kHdf5Signature, sizeof kHdf5Signature) == 0) return std::nullopt;
    return false;
  }
  std::uint32_t version = 0, crc = 0;
  std::uint64_t length = 0;
  std::memcpy(&version, block + 8, 4);
  std::memcpy(&length, block + 12, 8);
  std::memcpy(&crc, block + 20, 4);
  if (version != kSealVersion) return false;
  const SealInfo actual = checksum_after_block(fd, path);
  return actual.length == length && actual.crc == crc;
}

void save(const std::string& path, const nn::Sequential& model, const optim::Optimizer& optimizer,
          const Contents& contents) {
  QuietHdf5Errors quiet;
  // Temporary, write, fsync, rename, directory fsync: the data is on disk before the rename makes
  // it the checkpoint, and a failure removes the temporary.
  write_file_atomically(path, sealed(checkpoint_image(path, model, optimizer, contents)));
}

// ---------------------------------------------------------------- reading
namespace {

enum class Element { f32, f64, i64, u64 };

struct ElementInfo {
  H5T_class_t type_class;
  std::size_t size;
  H5T_sign_t sign;  // H5T_SGN_ERROR where it does not apply
  hid_t memory_type;
  const char* name;
};

ElementInfo info(Element e) {
  switch (e) {
    case Element::f32: return {H5T_FLOAT, 4, H5T_SGN_ERROR, H5T_NATIVE_FLOAT, "float32"};
    case Element::f64: return {H5T_FLOAT, 8, H5T_SGN_ERROR, H5T_NATIVE_DOUBLE, "float64"};
    case Element::i64: return {H5T_INTEGER, 8, H5T_SGN_2, H5T_NATIVE_INT64, "int64"};
    case Element::u64: return {H5T_INTEGER, 8, H5T_SGN_NONE, H5T_NATIVE_UINT64, "uint64"};
  }
  return {H5T_NO_CLASS, 0, H5T_SGN_ERROR, -1, "?"};
}

struct Raw {
  std::vector<std::int64_t> dims;
  std::vector<unsigned char> bytes;
  template <class T>
  T scalar() const {
    T v{};
    std::memcpy(&v, bytes.data(), sizeof v);
    return v;
  }
  template <class T>
  std::vector<T> vector() const {
    std::vector<T> v(bytes.size() / sizeof(T));
    if (!v.empty()) std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  }
};

class Reader {
 public:
  explicit Reader(const std::string& path) : path_(path) {
    std::error_code ec;
    if (!fs::exists(path, ec))
      throw InputError(fmt::format("{}: no such checkpoint file; pass a checkpoint written by dtrain "
                                   "(<run directory>/ckpt-<step>.h5)",
                                   path));
    if (fs::is_directory(path, ec))
      throw InputError(fmt::format("{}: is a directory, not a checkpoint file; pass one of its ckpt-<step>.h5 files",
                                   path));
    // A FIFO or device would block the open or the read forever.
    if (!fs::is_regular_file(path, ec))
      throw InputError(fmt::format("{}: is not a regular file (a FIFO, socket or device); pass a ckpt-<step>.h5 file",
                                   path));
    // Before HDF5 parses anything: a file whose whole-file checksum fails is refused here.
    if (const std::optional<bool> sealed = verify_seal(path); sealed && !*sealed)
      corrupt("whole-file checksum mismatch or no dtrain seal (the file was cut short or changed after it was "
              "written, or dtrain did not write it); use another checkpoint");
    const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
    if (is_hdf5 <= 0)
      corrupt(is_hdf5 == 0 ? std::string("no HDF5 signature, it is not an HDF5 file") : hdf5_detail());
    file_ = H5Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (!file_.valid()) corrupt(hdf5_detail());
    hsize_t size = 0;
    if (H5Fget_filesize(file_.get(), &size) < 0) corrupt(hdf5_detail());
    file_size_ = size;
    check_format_version();
  }

  const std::string& path() const { return path_; }
  hid_t file() const { return file_.get(); }

  [[noreturn]] void corrupt(const std::string& detail) const {
    throw InputError(fmt::format("{}: not a readable HDF5 checkpoint (truncated or corrupt): {}", path_, detail));
  }
  [[noreturn]] void bad(const std::string& what) const { throw InputError(fmt::format("{}: {}", path_, what)); }

  // Whether every component of an absolute path exists (H5Lexists needs the parents to exist).
  bool exists(const std::string& name) const {
    std::size_t pos = 0;
    while (pos != std::string::npos) {
      pos = name.find('/', pos + 1);
      const std::string prefix = name.substr(0, pos);
      const htri_t status = H5Lexists(file_.get(), prefix.c_str(), H5P_DEFAULT);
      if (status < 0) corrupt(fmt::format("looking up {}: {}", prefix, hdf5_detail()));
      if (status == 0) return false;
    }
    return true;
  }

  // Reads a dataset of `element`s and verifies its crc32. `expected`: the dims it must have,
  // `label`: how a shape mismatch names it ("variable", "optimizer slot").
  Raw read(const std::string& name, Element element, const std::optional<std::vector<std::int64_t>>& expected,
           const char* label) const {
    if (!exists(name))
      bad(expected ? fmt::format("missing {} {} of shape {}; the checkpoint was written for another model or dtrain",
                                 label, name, format_dims(*expected))
                   : fmt::format("missing dataset {}; the checkpoint is incomplete", name));
    H5Id ds(H5Dopen2(file_.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
    if (!ds.valid()) corrupt(fmt::format("{} is not a readable dataset ({})", name, hdf5_detail()));
    H5Id space(H5Dget_space(ds.get()), H5Sclose);
    H5Id type(H5Dget_type(ds.get()), H5Tclose);
    if (!space.valid() || !type.valid()) corrupt(fmt::format("{}: {}", name, hdf5_detail()));

    const ElementInfo want = info(element);
    const bool type_ok = H5Tget_class(type.get()) == want.type_class && H5Tget_size(type.get()) == want.size &&
                         (want.sign == H5T_SGN_ERROR || H5Tget_sign(type.get()) == want.sign);
    if (!type_ok) bad(fmt::format("{} is not {}; the checkpoint was not written by dtrain", name, want.name));

    Raw raw;
    const int rank = H5Sget_simple_extent_ndims(space.get());
    if (rank < 0 || rank > 32) corrupt(fmt::format("{} has an unreadable shape", name));
    std::vector<hsize_t> extent(static_cast<std::size_t>(rank));
    if (rank > 0 && H5Sget_simple_extent_dims(space.get(), extent.data(), nullptr) < 0)
      corrupt(fmt::format("{}: {}", name, hdf5_detail()));
    raw.dims.assign(extent.begin(), extent.end());
    if (expected && raw.dims != *expected) {
      if (std::string(label) == "dataset")
        bad(fmt::format("{} has shape {}, expected {}; the checkpoint was not written by this dtrain", name,
                        format_dims(raw.dims), format_dims(*expected)));
      bad(fmt::format("{} {} has shape {}, the model expects {}; the checkpoint was written for another model", label,
                      name, format_dims(raw.dims), format_dims(*expected)));
    }

    // Contiguous and uncompressed: a dataset larger than the file can only be a corrupt header,
    // and must not turn into a huge allocation.
    std::uint64_t bytes = want.size;
    for (hsize_t d : extent) {
      if (d != 0 && bytes > file_size_ / d) corrupt(fmt::format("{} claims shape {}, larger than the file", name,
                                                                format_dims(raw.dims)));
      bytes *= d;
    }
    raw.bytes.resize(static_cast<std::size_t>(bytes));
    if (bytes > 0 && H5Dread(ds.get(), want.memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, raw.bytes.data()) < 0)
      corrupt(fmt::format("reading {} failed ({})", name, hdf5_detail()));
    verify_crc(ds.get(), name, raw.bytes.data(), raw.bytes.size());
    return raw;
  }

  std::string read_string_dataset(const std::string& name) const {
    if (!exists(name)) bad(fmt::format("missing dataset {}; the checkpoint is incomplete", name));
    H5Id ds(H5Dopen2(file_.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
    if (!ds.valid()) corrupt(fmt::format("{} is not a readable dataset ({})", name, hdf5_detail()));
    H5Id space(H5Dget_space(ds.get()), H5Sclose);
    H5Id type(H5Dget_type(ds.get()), H5Tclose);
    if (!space.valid() || !type.valid()) corrupt(fmt::format("{}: {}", name, hdf5_detail()));
    if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) != 0 ||
        H5Sget_simple_extent_npoints(space.get()) != 1)
      bad(fmt::format("{} is not a fixed-length string; the checkpoint was not written by dtrain", name));
    const std::size_t size = H5Tget_size(type.get());
    if (size == 0 || size > file_size_) corrupt(fmt::format("{} claims {} bytes, more than the file", name, size));
    std::string value(size, '\0');
    if (H5Dread(ds.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, value.data()) < 0)
      corrupt(fmt::format("reading {} failed ({})", name, hdf5_detail()));
    verify_crc(ds.get(), name, value.data(), value.size());
    value.erase(value.find_last_not_of('\0') + 1);
    return value;
  }

  std::optional<std::int64_t> integer_attribute(const std::string& object, const char* attr_name) const {
    const htri_t present = H5Aexists_by_name(file_.get(), object.c_str(), attr_name, H5P_DEFAULT);
    if (present < 0) corrupt(fmt::format("attribute {} of {}: {}", attr_name, object, hdf5_detail()));
    if (present == 0) return std::nullopt;
    H5Id attr(H5Aopen_by_name(file_.get(), object.c_str(), attr_name, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    return single_integer(attr.get(), fmt::format("attribute {} of {}", attr_name, object));
  }

  // The value of an attribute that must hold one integer. Checked first: H5Aread writes every
  // element there is, so an array put in its place would overrun the one value read into.
  long long single_integer(hid_t attr, const std::string& what) const {
    H5Id type(attr >= 0 ? H5Aget_type(attr) : -1, H5Tclose);
    H5Id space(attr >= 0 ? H5Aget_space(attr) : -1, H5Sclose);
    if (!type.valid() || !space.valid()) corrupt(fmt::format("{}: {}", what, hdf5_detail()));
    if (H5Tget_class(type.get()) != H5T_INTEGER || H5Sget_simple_extent_npoints(space.get()) != 1)
      bad(fmt::format("{} is not a single integer; the checkpoint is corrupt", what));
    long long value = 0;
    if (H5Aread(attr, H5T_NATIVE_LLONG, &value) < 0)
      corrupt(fmt::format("reading {} failed ({})", what, hdf5_detail()));
    return value;
  }

  // Fixed- or variable-length (h5py's default), so a file touched by other tools still reads.
  std::optional<std::string> string_attribute(const std::string& object, const char* attr_name) const {
    const htri_t present = H5Aexists_by_name(file_.get(), object.c_str(), attr_name, H5P_DEFAULT);
    if (present < 0) corrupt(fmt::format("attribute {} of {}: {}", attr_name, object, hdf5_detail()));
    if (present == 0) return std::nullopt;
    H5Id attr(H5Aopen_by_name(file_.get(), object.c_str(), attr_name, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    H5Id type(attr.valid() ? H5Aget_type(attr.get()) : -1, H5Tclose);
    H5Id space(attr.valid() ? H5Aget_space(attr.get()) : -1, H5Sclose);
    if (!type.valid() || !space.valid()) corrupt(fmt::format("attribute {} of {}: {}", attr_name, object, hdf5_detail()));
    if (H5Tget_class(type.get()) != H5T_STRING || H5Sget_simple_extent_npoints(space.get()) != 1)
      bad(fmt::format("attribute {} of {} is not a single string", attr_name, object));
    std::string value;
    if (H5Tis_variable_str(type.get()) > 0) {
      H5Id memory_type(H5Tcopy(H5T_C_S1), H5Tclose);
      char* text = nullptr;
      if (!memory_type.valid() || H5Tset_size(memory_type.get(), H5T_VARIABLE) < 0 ||
          H5Aread(attr.get(), memory_type.get(), &text) < 0)
        corrupt(fmt::format("reading attribute {} of {} failed ({})", attr_name, object, hdf5_detail()));
      if (text) {
        value = text;
        H5free_memory(text);
      }
    } else {
      const std::size_t size = H5Tget_size(type.get());
      if (size == 0 || size > file_size_) corrupt(fmt::format("attribute {} of {} is too large", attr_name, object));
      value.assign(size, '\0');
      if (H5Aread(attr.get(), type.get(), value.data()) < 0)
        corrupt(fmt::format("reading attribute {} of {} failed ({})", attr_name, object, hdf5_detail()));
      value.erase(value.find_last_not_of('\0') + 1);
    }
    return value;
  }

  // The names of a group's direct members.
  std::vector<std::string> members(const std::string& group) const {
    H5G_info_t group_info{};
    if (H5Gget_info_by_name(file_.get(), group.c_str(), &group_info, H5P_DEFAULT) < 0)
      corrupt(fmt::format("{} is not a readable group ({})", group, hdf5_detail()));
    std::vector<std::string> names;
    for (hsize_t i = 0; i < group_info.nlinks; ++i) {
      const ssize_t length = H5Lget_name_by_idx(file_.get(), group.c_str(), H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0,
                                                H5P_DEFAULT);
      if (length < 0) corrupt(fmt::format("listing {}: {}", group, hdf5_detail()));
      std::string name(static_cast<std::size_t>(length) + 1, '\0');
      if (H5Lget_name_by_idx(file_.get(), group.c_str(), H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(),
                             H5P_DEFAULT) < 0)
        corrupt(fmt::format("listing {}: {}", group, hdf5_detail()));
      name.resize(static_cast<std::size_t>(length));
      names.push_back(std::move(name));
    }
    return names;
  }

  // Every dataset below `group`, as absolute paths.
  std::vector<std::string> datasets_under(const std::string& group) const {
    H5Id g(H5Gopen2(file_.get(), group.c_str(), H5P_DEFAULT), H5Gclose);
    if (!g.valid()) corrupt(fmt::format("{} is not a readable group ({})", group, hdf5_detail()));
    struct Visit {
      std::string prefix;
      std::vector<std::string> found;
    } visit{group + "/", {}};
    const herr_t status = H5Lvisit(
        g.get(), H5_INDEX_NAME, H5_ITER_INC,
        [](hid_t parent, const char* name, const H5L_info_t*, void* data) -> herr_t {
          hid_t object = H5Oopen(parent, name, H5P_DEFAULT);
          if (object < 0) return -1;
          const bool is_dataset = H5Iget_type(object) == H5I_DATASET;
          H5Oclose(object);
          if (is_dataset) {
            auto* v = static_cast<Visit*>(data);
            v->found.push_back(v->prefix + name);
          }
          return 0;
        },
        &visit);
    if (status < 0) corrupt(fmt::format("listing {}: {}", group, hdf5_detail()));
    return visit.found;
  }

 private:
  void verify_crc(hid_t dataset, const std::string& name, const void* data, std::size_t bytes) const {
    const htri_t present = H5Aexists(dataset, "crc32");
    if (present < 0) corrupt(fmt::format("{}: {}", name, hdf5_detail()));
    if (present == 0) bad(fmt::format("{} has no crc32 attribute; the checkpoint was not written by dtrain", name));
    H5Id attr(H5Aopen(dataset, "crc32", H5P_DEFAULT), H5Aclose);
    const long long stored = single_integer(attr.get(), fmt::format("the crc32 attribute of {}", name));
    const std::uint32_t computed = crc32_of(data, bytes);
    if (stored != static_cast<long long>(computed))
      bad(fmt::format("checksum mismatch in {} (stored crc32 {:08x}, computed {:08x}); the file is corrupt: use "
                      "another checkpoint",
                      name, stored, computed));
  }

  void check_format_version() const {
    const std::optional<std::int64_t> version = integer_attribute("/", "format_version");
    if (!version) bad("not a dtrain checkpoint (no format_version attribute on /)");
    if (*version != kFormatVersion)
      bad(fmt::format("checkpoint format version {} (this dtrain reads {}); use the dtrain release that wrote it",
                      *version, kFormatVersion));
  }

  std::string path_;
  H5Id file_{-1, H5Fclose};
  std::uint64_t file_size_ = 0;
};

std::int64_t read_scalar_i64(const Reader& r, const std::string& name) {
  return r.read(name, Element::i64, std::vector<std::int64_t>{}, "dataset").scalar<std::int64_t>();
}

std::vector<std::int64_t> dims_of(const Variable& v) { return v.value.shape().to_vector(); }

// Reads a float32 dataset shaped like `v` and refuses NaN and infinity in it. A run that diverged
// (or a file resealed around such values) passes every checksum; evaluating or training on from
// it would only report NaN, so the variable that holds them is named instead.
Raw read_finite(const Reader& r, const std::string& name, const Variable& v, const char* label) {
  Raw raw = r.read(name, Element::f32, dims_of(v), label);
  std::size_t count = 0, first = 0;
  const std::size_t n = raw.bytes.size() / sizeof(float);
  for (std::size_t i = 0; i < n; ++i) {
    float value;
    std::memcpy(&value, raw.bytes.data() + i * sizeof(float), sizeof value);
    if (!std::isfinite(value) && count++ == 0) first = i;
  }
  if (count > 0)
    r.bad(fmt::format("{} holds {} non-finite value{} (NaN or infinity; the first at flat index {}); the run that "
                      "wrote it had diverged or the file was altered: use an earlier checkpoint",
                      name, count, count == 1 ? "" : "s", first));
  return raw;
}

Contents read_contents(const Reader& r) {
  Contents c;
  c.dtrain_version = r.string_attribute("/", "dtrain_version").value_or("");
  TrainingState& s = c.state;
  s.epoch = read_scalar_i64(r, "/state/epoch");
  s.step_in_epoch = read_scalar_i64(r, "/state/step_in_epoch");
  s.global_step = read_scalar_i64(r, "/state/global_step");
  s.seed = r.read("/state/seed", Element::u64, std::vector<std::int64_t>{}, "dataset").scalar<std::uint64_t>();
  s.epoch_loss_sum = r.read("/state/epoch_loss_sum", Element::f64, std::vector<std::int64_t>{}, "dataset").scalar<double>();
  s.epoch_samples = read_scalar_i64(r, "/state/epoch_samples");
  // Optional: older checkpoints do not say which layout wrote them.
  for (auto [name, value] : {std::pair{"/state/replicas_in_sync", &s.replicas_in_sync}, {"/state/workers", &s.workers},
                             {"/state/global_batch", &s.global_batch}})
    if (r.exists(name)) *value = std::max<std::int64_t>(0, read_scalar_i64(r, name));
  // Ranges any run can reach: an epoch counter of int range, a step count training can still add
  // to, a step within the steps done, finite running figures. Outside them the file is corrupt.
  const bool counters_ok = s.epoch >= 0 && s.epoch < kMaxEpochs && s.step_in_epoch >= 0 && s.global_step >= 0 &&
                           s.global_step <= kMaxGlobalStep && s.step_in_epoch <= s.global_step && s.epoch_samples >= 0 &&
                           s.epoch_samples <= kMaxGlobalStep &&
                           std::isfinite(s.epoch_loss_sum);
  if (!counters_ok)
    r.bad(fmt::format("/state holds impossible values (epoch {}, step_in_epoch {}, global_step {}, epoch_samples {}, "
                      "epoch_loss_sum {}); the checkpoint is corrupt",
                      s.epoch, s.step_in_epoch, s.global_step, s.epoch_samples, s.epoch_loss_sum));

  if (!r.exists("/state/metrics")) r.bad("missing group /state/metrics; the checkpoint is incomplete");
  const std::vector<std::string> metrics = r.members("/state/metrics");
  for (std::size_t m = 0; m < metrics.size(); ++m) {
    // Members list in name order ("10" before "2"), so look each index up instead of trusting order.
    const std::string group = fmt::format("/state/metrics/{}", m);
    if (!r.exists(group))
      r.bad(fmt::format("/state/metrics has {} members but no {}; the checkpoint is corrupt", metrics.size(), group));
    s.metric_counts.push_back(r.read(group + "/counts", Element::i64, std::nullopt, "dataset").vector<std::int64_t>());
    s.metric_sums.push_back(r.read(group + "/sums", Element::f64, std::nullopt, "dataset").vector<double>());
    const auto& counts = s.metric_counts.back();
    if (std::any_of(counts.begin(), counts.end(), [](std::int64_t n) { return n < 0; }))
      r.bad(fmt::format("{}/counts holds a negative count; the checkpoint is corrupt", group));
  }
  c.experiment_yaml = r.read_string_dataset("/experiment");
  return c;
}

// Model weights, in model.variables() order, verified against the model's shapes.
std::vector<Raw> read_model(const Reader& r, const nn::Sequential& model) {
  const auto& vars = model.variables();
  std::vector<Raw> values;
  values.reserve(vars.size());
  std::set<std::string> expected;
  for (const Variable* v : vars) {
    DTRAIN_CHECK(v->value.defined() && v->value.dtype() == DType::f32,
                 fmt::format("variable {} must hold f32 values to be restored", v->name));
    const std::string name = model_dataset(v->name);
    expected.insert(name);
    values.push_back(read_finite(r, name, *v, "variable"));
  }
  if (!r.exists("/model")) r.bad("missing group /model; the checkpoint is incomplete");
  for (const std::string& name : r.datasets_under("/model")) {
    if (!expected.contains(name))
      r.bad(fmt::format("variable {} is not in the model (which has {} variables); the checkpoint was written for "
                        "another model",
                        name, vars.size()));
  }
  return values;
}

struct OptimizerState {
  std::int64_t iterations = 0;
  std::vector<Raw> slots;  // [variable * slots_per_variable + slot], as Optimizer::slot indexes them
};

OptimizerState read_optimizer(const Reader& r, const nn::Sequential& model, const optim::Optimizer& optimizer) {
  if (!r.exists("/optimizer")) r.bad("missing group /optimizer; the checkpoint is incomplete");
  const std::string stored_name = r.string_attribute("/optimizer", "name").value_or("");
  if (stored_name != optimizer.name())
    r.bad(fmt::format("optimizer mismatch (checkpoint has {}, the experiment {}); restore it with the experiment "
                      "stored in the checkpoint",
                      stored_name.empty() ? "none" : stored_name, optimizer.name()));
  OptimizerState state;
  const std::optional<std::int64_t> iterations = r.integer_attribute("/optimizer", "iterations");
  if (!iterations || *iterations < 0 || *iterations > kMaxGlobalStep)
    r.bad(fmt::format("/optimizer has no valid iterations attribute (a count of updates from 0 to {}{}); the "
                      "checkpoint is corrupt",
                      kMaxGlobalStep, iterations ? fmt::format(", not {}", *iterations) : std::string()));
  state.iterations = *iterations;

  const std::vector<std::string> slot_names = optimizer.slot_names();
  const auto join = [](const std::vector<std::string>& names) {
    return names.empty() ? std::string("none") : fmt::format("{}", fmt::join(names, ", "));
  };
  std::vector<std::string> stored_slots = r.members("/optimizer");
  std::vector<std::string> wanted = slot_names;
  std::sort(stored_slots.begin(), stored_slots.end());
  std::sort(wanted.begin(), wanted.end());
  // The same kind configured differently (SGD with and without momentum) keeps different slots.
  if (stored_slots != wanted)
    r.bad(fmt::format("optimizer mismatch (checkpoint has {} slots {}, the experiment's {} uses {}); restore it with "
                      "the experiment stored in the checkpoint",
                      stored_name, join(stored_slots), optimizer.name(), join(wanted)));

  const auto& vars = model.trainable_variables();
  state.slots.reserve(vars.size() * slot_names.size());
  std::set<std::string> expected;
  for (const Variable* v : vars) {
    for (const std::string& slot : slot_names) {
      const std::string name = slot_dataset(slot, v->name);
      expected.insert(name);
      state.slots.push_back(read_finite(r, name, *v, "optimizer slot"));
    }
  }
  for (const std::string& slot : slot_names) {
    for (const std::string& name : r.datasets_under("/optimizer/" + slot)) {
      if (!expected.contains(name))
        r.bad(fmt::format("optimizer slot {} belongs to no variable of the model; the checkpoint was written for "
                          "another model",
                          name));
    }
  }
  return state;
}

void write_model(nn::Sequential& model, const std::vector<Raw>& values) {
  const auto& vars = model.variables();
  for (std::size_t i = 0; i < vars.size(); ++i) {
    DTRAIN_CHECK(vars[i]->value.bytes() == values[i].bytes.size(), fmt::format("variable {} has an unexpected size", vars[i]->name));
    if (!values[i].bytes.empty()) model.context().copy_from_host(values[i].bytes.data(), vars[i]->value);
  }
}

}  // namespace

Contents peek(const std::string& path) {
  QuietHdf5Errors quiet;
  Reader reader(path);
  return read_contents(reader);
}

Contents restore_model(const std::string& path, nn::Sequential& model) {
  QuietHdf5Errors quiet;
  Reader reader(path);
  Contents contents = read_contents(reader);
  std::vector<Raw> values = read_model(reader, model);
  write_model(model, values);
  return contents;
}

Contents restore(const std::string& path, nn::Sequential& model, optim::Optimizer& optimizer) {
  QuietHdf5Errors quiet;
  Reader reader(path);
  Contents contents = read_contents(reader);
  std::vector<Raw> values = read_model(reader, model);
  OptimizerState state = read_optimizer(reader, model, optimizer);

  // Nothing below can fail on the file's account: everything was verified above. build() comes
  // first because it is the one step that checks the caller (an optimizer built for other variables).
  const auto& vars = model.trainable_variables();
  optimizer.build(vars);
  write_model(model, values);
  const std::size_t slots_per_variable = optimizer.slot_names().size();
  for (std::size_t i = 0; i < vars.size(); ++i) {
    for (std::size_t s = 0; s < slots_per_variable; ++s) {
      const Raw& raw = state.slots[i * slots_per_variable + s];
      Tensor& slot = optimizer.slot(i, s);
      DTRAIN_CHECK(slot.bytes() == raw.bytes.size(), fmt::format("optimizer slot {} of {} has an unexpected size", s,
                                                                 vars[i]->name));
      if (!raw.bytes.empty()) model.context().copy_from_host(raw.bytes.data(), slot);
    }
  }
  optimizer.set_iterations(state.iterations);
  return contents;
}

}  // namespace dtrain::checkpoint
