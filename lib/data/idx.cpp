#include "data/idx.hpp"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::data {
namespace {

namespace fs = std::filesystem;

// Far above any real IDX file, low enough that the byte count cannot overflow.
constexpr std::uint64_t kMaxPayloadBytes = std::uint64_t{1} << 40;
constexpr std::size_t kChunkBytes = std::size_t{1} << 20;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A byte stream from a plain or a gzip file; stream errors become InputErrors naming the path.
class ByteReader {
 public:
  explicit ByteReader(const std::string& path) : path_(path), gzip_(ends_with(path, ".gz")) {
    std::error_code ec;
    if (!fs::exists(path, ec))
      throw InputError(fmt::format("{}: no such file; set data.path to the directory that holds the IDX files", path));
    if (fs::is_directory(path, ec)) throw InputError(fmt::format("{}: is a directory, not an IDX file", path));
    // A FIFO or device would block the read forever or never end.
    if (!fs::is_regular_file(path, ec))
      throw InputError(fmt::format("{}: is not a regular file (a FIFO, socket or device), not an IDX file", path));
    errno = 0;
    if (gzip_) {
      gz_ = gzopen(path.c_str(), "rb");
      if (!gz_) throw InputError(fmt::format("{}: cannot open: {}", path, std::strerror(errno ? errno : ENOMEM)));
    } else {
      file_ = std::fopen(path.c_str(), "rb");
      if (!file_) throw InputError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
    }
  }
  ~ByteReader() {
    if (gz_) gzclose(gz_);
    if (file_) std::fclose(file_);
  }
  ByteReader(const ByteReader&) = delete;
  ByteReader& operator=(const ByteReader&) = delete;

  // Reads up to n bytes; fewer only at the end of the data.
  std::size_t read(unsigned char* dst, std::size_t n) {
    std::size_t total = 0;
    while (total < n) {
      std::size_t want = std::min(n - total, kChunkBytes);
      std::size_t got = 0;
      if (gzip_) {
        int r = gzread(gz_, dst + total, static_cast<unsigned>(want));
        if (r < 0) throw_gzip_error();
        got = static_cast<std::size_t>(r);
      } else {
        got = std::fread(dst + total, 1, want, file_);
        if (got < want && std::ferror(file_))
          throw InputError(fmt::format("{}: read failed: {}", path_, std::strerror(errno)));
      }
      total += got;
      if (got < want) {
        // A gzip stream that ends early reads as a short read with an error set.
        if (gzip_) check_gzip();
        break;
      }
    }
    return total;
  }

 private:
  void check_gzip() {
    int code = Z_OK;
    gzerror(gz_, &code);
    if (code != Z_OK && code != Z_STREAM_END) throw_gzip_error();
  }
  [[noreturn]] void throw_gzip_error() {
    int code = Z_OK;
    std::string message = gzerror(gz_, &code);
    // zlib prefixes its message with the path, which ours already starts with.
    if (message.rfind(path_ + ": ", 0) == 0) message.erase(0, path_.size() + 2);
    throw InputError(fmt::format("{}: corrupt gzip data ({}); download the file again", path_,
                                 message.empty() ? "zlib error" : message));
  }

  std::string path_;
  bool gzip_;
  gzFile gz_ = nullptr;
  std::FILE* file_ = nullptr;
};

std::uint32_t load_be32(const unsigned char* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | std::uint32_t{p[3]};
}

std::uint64_t load_be64(const unsigned char* p) {
  return (std::uint64_t{load_be32(p)} << 32) | load_be32(p + 4);
}

struct ElementType {
  std::uint8_t code;
  std::size_t file_bytes;
  DType dtype;
  const char* name;
};

const ElementType* element_type(std::uint8_t code) {
  static constexpr ElementType kTypes[] = {
      {0x08, 1, DType::u8, "ubyte"}, {0x09, 1, DType::i32, "byte"},   {0x0B, 2, DType::i32, "short"},
      {0x0C, 4, DType::i32, "int"},  {0x0D, 4, DType::f32, "float"}, {0x0E, 8, DType::f32, "double"},
  };
  for (const auto& t : kTypes)
    if (t.code == code) return &t;
  return nullptr;
}

void decode(const ElementType& type, const unsigned char* src, Tensor& out) {
  const std::size_t n = static_cast<std::size_t>(out.numel());
  switch (type.code) {
    case 0x08: std::memcpy(out.raw(), src, n); break;
    case 0x09: {
      auto* dst = out.data<std::int32_t>();
      for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<std::int8_t>(src[i]);
      break;
    }
    case 0x0B: {
      auto* dst = out.data<std::int32_t>();
      for (std::size_t i = 0; i < n; ++i)
        dst[i] = static_cast<std::int16_t>(static_cast<std::uint16_t>((src[2 * i] << 8) | src[2 * i + 1]));
      break;
    }
    case 0x0C: {
      auto* dst = out.data<std::int32_t>();
      for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<std::int32_t>(load_be32(src + 4 * i));
      break;
    }
    case 0x0D: {
      auto* dst = out.data<float>();
      for (std::size_t i = 0; i < n; ++i) {
        std::uint32_t bits = load_be32(src + 4 * i);
        std::memcpy(&dst[i], &bits, 4);
      }
      break;
    }
    case 0x0E: {
      auto* dst = out.data<float>();
      for (std::size_t i = 0; i < n; ++i) {
        std::uint64_t bits = load_be64(src + 8 * i);
        double v;
        std::memcpy(&v, &bits, 8);
        dst[i] = static_cast<float>(v);
      }
      break;
    }
    default: DTRAIN_CHECK(false, "decode called with an unchecked IDX type");
  }
}

std::string find_idx_file(const std::string& dir, const std::string& name) {
  std::error_code ec;
  fs::path plain = fs::path(dir) / name;
  if (fs::exists(plain, ec)) return plain.string();
  fs::path gz = fs::path(dir) / (name + ".gz");
  if (fs::exists(gz, ec)) return gz.string();
  if (!fs::is_directory(dir, ec))
    throw InputError(fmt::format("{}: no such directory; set data.path to the directory that holds the IDX files", dir));
  throw InputError(fmt::format("{}[.gz]: no such file; set data.path to the directory that holds the IDX files",
                               plain.string()));
}

}  // namespace

Tensor read_idx(const std::string& path) {
  ByteReader reader(path);

  unsigned char magic[4];
  std::size_t got = reader.read(magic, 4);
  if (got < 4) throw InputError(fmt::format("{}: truncated: {} bytes, too short for an IDX header", path, got));
  const std::uint32_t magic_value = load_be32(magic);
  const std::uint8_t rank = magic[3];
  if (magic[0] != 0 || magic[1] != 0 || rank == 0 || rank > 8)
    throw InputError(fmt::format(
        "{}: bad IDX magic 0x{:08x}; expected 0x00000803 (images) or 0x00000801 (labels); is this an IDX file?", path,
        magic_value));
  const ElementType* type = element_type(magic[2]);
  if (!type)
    throw InputError(fmt::format(
        "{}: unsupported IDX element type 0x{:02x} (magic 0x{:08x}); known: 0x08 ubyte, 0x09 byte, 0x0B short, "
        "0x0C int, 0x0D float, 0x0E double",
        path, magic[2], magic_value));

  unsigned char dim_bytes[4 * 8];
  got = reader.read(dim_bytes, 4u * rank);
  if (got < 4u * rank)
    throw InputError(fmt::format("{}: truncated: header of rank {} needs {} bytes of dimensions, file has {}", path,
                                 rank, 4u * rank, got));
  std::vector<std::int64_t> dims;
  std::uint64_t promised = type->file_bytes;
  for (int i = 0; i < rank; ++i) {
    std::uint32_t d = load_be32(dim_bytes + 4 * i);
    dims.push_back(d);
    // Checked before multiplying so a lying header cannot overflow the count.
    if (d != 0 && promised > kMaxPayloadBytes / d)
      throw InputError(fmt::format("{}: header dimensions {} promise more than {} bytes; the header is corrupt", path,
                                   Shape(dims).to_string(), kMaxPayloadBytes));
    promised *= d;
  }

  // Grow with the data actually present; read one byte past the promise to detect trailing data.
  std::vector<unsigned char> payload;
  try {
    payload.reserve(static_cast<std::size_t>(std::min<std::uint64_t>(promised + 1, 16 * kChunkBytes)));
    while (payload.size() < promised + 1) {
      std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(promised + 1 - payload.size(), kChunkBytes));
      std::size_t old = payload.size();
      payload.resize(old + want);
      std::size_t n = reader.read(payload.data() + old, want);
      payload.resize(old + n);
      if (n < want) break;
    }
  } catch (const std::bad_alloc&) {
    data_out_of_memory(path, "its data", fmt::format("out of memory reading {} bytes", promised));
  }
  if (payload.size() < promised)
    throw InputError(fmt::format("{}: truncated: header promises {} bytes of data ({} {} elements), file has {}", path,
                                 promised, Shape(dims).to_string(), type->name, payload.size()));
  if (payload.size() > promised)
    throw InputError(fmt::format(
        "{}: more data than the header promises ({} bytes for {} {} elements); the file is not a valid IDX file", path,
        promised, Shape(dims).to_string(), type->name));

  Tensor out = data_tensor(path, "its data", Shape(dims), type->dtype);
  decode(*type, payload.data(), out);
  return out;
}

Dataset load_idx_split(const std::string& dir, const std::string& prefix, int num_classes) {
  const std::string images_path = find_idx_file(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = find_idx_file(dir, prefix + "-labels-idx1-ubyte");
  Tensor images = read_idx(images_path);
  Tensor labels = read_idx(labels_path);

  Dataset ds;
  if (images.shape().rank() < 2)
    throw InputError(fmt::format("{}: holds {} values of rank 1; expected images (N, H, W)", images_path,
                                 images.shape().to_string()));
  if (images.dtype() == DType::i32)
    throw InputError(fmt::format("{}: images must be ubyte (0x08) or float (0x0D) elements, not integers wider than a byte",
                                 images_path));
  if (images.shape().rank() == 3) images = images.reshaped(Shape{images.shape()[0], images.shape()[1], images.shape()[2], 1});
  if (labels.shape().rank() != 1 || labels.dtype() == DType::f32)
    throw InputError(fmt::format("{}: labels must be a 1-D integer IDX file, got {} {}", labels_path,
                                 dtype_name(labels.dtype()), labels.shape().to_string()));
  if (images.shape()[0] != labels.shape()[0])
    throw InputError(fmt::format("{} holds {} images but {} holds {} labels; the two files do not belong together",
                                 images_path, images.shape()[0], labels_path, labels.shape()[0]));

  Tensor y(Shape{labels.shape()[0]}, DType::i32);
  auto* dst = y.data<std::int32_t>();
  std::int32_t max_label = -1;
  for (std::int64_t i = 0; i < labels.numel(); ++i) {
    std::int32_t v = labels.dtype() == DType::u8 ? labels.data<std::uint8_t>()[i] : labels.data<std::int32_t>()[i];
    if (v < 0 || (num_classes > 0 && v >= num_classes)) throw InputError(label_out_of_range(labels_path, v, i, num_classes));
    dst[i] = v;
    max_label = std::max(max_label, v);
  }

  check_finite(images, images_path, "images");
  ds.x = images;
  ds.y = y;
  ds.labels_source = labels_path;
  ds.num_classes = num_classes > 0 ? num_classes : max_label + 1;
  ds.classes_from_labels = num_classes <= 0;
  ds.x_scale = images.dtype() == DType::u8 ? 1.0f / 255.0f : 1.0f;
  ds.description = fmt::format("IDX {}: {} examples, x {} {}, from {}", prefix, ds.size(), images.shape().to_string(),
                               dtype_name(images.dtype()), images_path);
  return ds;
}

}  // namespace dtrain::data
