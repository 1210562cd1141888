// Data sources: IDX (plain and gzip), HDF5, synthetic, repeated tensors, splits.
#include <doctest/doctest.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "config/experiment.hpp"
#include "core/error.hpp"
#include "data/dataset.hpp"
#include "data/hdf5_source.hpp"
#include "data/idx.hpp"

using namespace dtrain;
using namespace dtrain::data;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test case, removed afterwards.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() / ("dtrain_test_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void put_be32(std::vector<unsigned char>& out, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<unsigned char>(v >> shift));
}

std::vector<unsigned char> idx_bytes(std::uint8_t type, const std::vector<std::uint32_t>& dims,
                                     const std::vector<unsigned char>& payload) {
  std::vector<unsigned char> out{0, 0, type, static_cast<unsigned char>(dims.size())};
  for (auto d : dims) put_be32(out, d);
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

void write_plain(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void write_gz(const std::string& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

std::vector<unsigned char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Images of n samples of h x w where pixel j of sample i is (i * 7 + j) % 256; labels i % classes.
void write_idx_split(const TempDir& dir, const std::string& prefix, std::uint32_t n, std::uint32_t h, std::uint32_t w,
                     int classes, bool gz) {
  std::vector<unsigned char> pixels, labels;
  for (std::uint32_t i = 0; i < n; ++i) {
    for (std::uint32_t j = 0; j < h * w; ++j) pixels.push_back(static_cast<unsigned char>((i * 7 + j) % 256));
    labels.push_back(static_cast<unsigned char>(i % static_cast<std::uint32_t>(classes)));
  }
  const std::string suffix = gz ? ".gz" : "";
  auto write = gz ? write_gz : write_plain;
  write(dir.file(prefix + "-images-idx3-ubyte" + suffix), idx_bytes(0x08, {n, h, w}, pixels));
  write(dir.file(prefix + "-labels-idx1-ubyte" + suffix), idx_bytes(0x08, {n}, labels));
}

// The InputError message read_idx gives for `path`; fails the test when none is thrown.
std::string idx_error(const std::string& path) {
  try {
    read_idx(path);
  } catch (const InputError& e) {
    return e.what();
  }
  FAIL("read_idx(" << path << ") did not throw InputError");
  return {};
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("read_idx reads plain and gzip files alike") {
  TempDir dir;
  std::vector<unsigned char> pixels;
  for (int i = 0; i < 2 * 3 * 4; ++i) pixels.push_back(static_cast<unsigned char>(i * 10));
  auto bytes = idx_bytes(0x08, {2, 3, 4}, pixels);
  write_plain(dir.file("a-idx3-ubyte"), bytes);
  write_gz(dir.file("a-idx3-ubyte.gz"), bytes);
  for (const char* name : {"a-idx3-ubyte", "a-idx3-ubyte.gz"}) {
    CAPTURE(name);
    Tensor t = read_idx(dir.file(name));
    CHECK(t.dtype() == DType::u8);
    CHECK(t.shape() == Shape{2, 3, 4});
    CHECK(t.data<std::uint8_t>()[0] == 0);
    CHECK(t.data<std::uint8_t>()[23] == 230);
  }
}

TEST_CASE("read_idx decodes big-endian int and float elements") {
  TempDir dir;
  std::vector<unsigned char> ints;
  put_be32(ints, 0x01020304u);
  put_be32(ints, static_cast<std::uint32_t>(-5));
  write_plain(dir.file("i"), idx_bytes(0x0C, {2}, ints));
  Tensor t = read_idx(dir.file("i"));
  REQUIRE(t.dtype() == DType::i32);
  CHECK(t.data<std::int32_t>()[0] == 0x01020304);
  CHECK(t.data<std::int32_t>()[1] == -5);

  std::vector<unsigned char> floats;
  put_be32(floats, 0x3FC00000u);  // 1.5f
  write_gz(dir.file("f.gz"), idx_bytes(0x0D, {1, 1}, floats));
  Tensor f = read_idx(dir.file("f.gz"));
  REQUIRE(f.dtype() == DType::f32);
  CHECK(f.data<float>()[0] == 1.5f);
}

TEST_CASE("read_idx rejects missing, truncated, mistyped and lying files with the path in the message") {
  TempDir dir;
  std::vector<unsigned char> pixels(2 * 2 * 2, 7);

  SUBCASE("missing file") {
    std::string msg = idx_error(dir.file("nothing-here.gz"));
    CHECK(contains(msg, dir.file("nothing-here.gz")));
    CHECK(contains(msg, "no such file"));
    CHECK(contains(msg, "data.path"));
  }
  SUBCASE("bad magic") {
    write_plain(dir.file("bad"), {'G', 'I', 'F', '8', 0, 0, 0, 0});
    std::string msg = idx_error(dir.file("bad"));
    CHECK(contains(msg, dir.file("bad")));
    CHECK(contains(msg, "bad IDX magic 0x47494638"));
  }
  SUBCASE("unknown element type") {
    write_plain(dir.file("type"), idx_bytes(0x0A, {1}, {0}));
    CHECK(contains(idx_error(dir.file("type")), "unsupported IDX element type 0x0a"));
  }
  SUBCASE("truncated data, plain and gzip") {
    auto bytes = idx_bytes(0x08, {2, 2, 2}, pixels);
    bytes.resize(bytes.size() - 3);
    write_plain(dir.file("t"), bytes);
    write_gz(dir.file("t.gz"), bytes);
    for (const auto& p : {dir.file("t"), dir.file("t.gz")}) {
      std::string msg = idx_error(p);
      CHECK(contains(msg, p));
      CHECK(contains(msg, "truncated: header promises 8 bytes of data"));
      CHECK(contains(msg, "file has 5"));
    }
  }
  SUBCASE("truncated header") {
    write_plain(dir.file("h"), {0, 0, 8, 3, 0, 0});
    CHECK(contains(idx_error(dir.file("h")), "truncated"));
  }
  SUBCASE("lying header: billions of elements promised, a few present") {
    write_gz(dir.file("lie.gz"), idx_bytes(0x08, {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFu}, pixels));
    CHECK(contains(idx_error(dir.file("lie.gz")), dir.file("lie.gz")));
    write_plain(dir.file("lie"), idx_bytes(0x08, {60000, 28, 28}, pixels));
    std::string msg = idx_error(dir.file("lie"));
    CHECK(contains(msg, "header promises 47040000 bytes"));
    CHECK(contains(msg, "file has 8"));
  }
  SUBCASE("trailing data") {
    auto bytes = idx_bytes(0x08, {2, 2, 2}, pixels);
    bytes.push_back(1);
    write_plain(dir.file("long"), bytes);
    CHECK(contains(idx_error(dir.file("long")), "more data than the header promises"));
  }
  SUBCASE("corrupt gzip") {
    std::vector<unsigned char> big(4096);
    for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<unsigned char>((i * 31) ^ (i >> 3));
    write_gz(dir.file("c.gz"), idx_bytes(0x08, {4096}, big));
    auto gz = read_file(dir.file("c.gz"));
    REQUIRE(gz.size() > 40);
    for (std::size_t i = 20; i < 30; ++i) gz[i] ^= 0xA5;
    write_plain(dir.file("c.gz"), gz);
    std::string msg = idx_error(dir.file("c.gz"));
    CHECK(contains(msg, dir.file("c.gz") + ": corrupt gzip data ("));
  }
  SUBCASE("gzip cut short") {
    write_gz(dir.file("cut.gz"), idx_bytes(0x08, {2, 2, 2}, pixels));
    auto gz = read_file(dir.file("cut.gz"));
    gz.resize(gz.size() / 2);
    write_plain(dir.file("cut.gz"), gz);
    CHECK(contains(idx_error(dir.file("cut.gz")), dir.file("cut.gz") + ": corrupt gzip data (unexpected end of file)"));
  }
}

TEST_CASE("load_idx_split pairs images and labels and adds the channel dimension") {
  TempDir dir;
  write_idx_split(dir, "train", 12, 3, 2, 4, /*gz=*/true);
  write_idx_split(dir, "t10k", 5, 3, 2, 4, /*gz=*/false);
  Dataset train = load_idx_split(dir.path.string(), "train");
  CHECK(train.x.shape() == Shape{12, 3, 2, 1});
  CHECK(train.x.dtype() == DType::u8);
  CHECK(train.y.shape() == Shape{12});
  CHECK(train.y.dtype() == DType::i32);
  CHECK(train.num_classes == 4);
  CHECK(train.x_scale == doctest::Approx(1.0 / 255.0));
  CHECK(train.y.data<std::int32_t>()[5] == 1);
  CHECK(train.x.data<std::uint8_t>()[1 * 6 + 2] == 9);
  Dataset test = load_idx_split(dir.path.string(), "t10k", 10);
  CHECK(test.size() == 5);
  CHECK(test.num_classes == 10);
  CHECK_THROWS_AS(load_idx_split(dir.path.string(), "t10k", 3), InputError);  // label 3 is not below 3

  SUBCASE("count mismatch") {
    write_plain(dir.file("t10k-labels-idx1-ubyte"), idx_bytes(0x08, {4}, {0, 1, 2, 3}));
    try {
      load_idx_split(dir.path.string(), "t10k");
      FAIL("no error");
    } catch (const InputError& e) {
      CHECK(contains(e.what(), "holds 5 images but"));
    }
  }
  SUBCASE("missing files name the directory and the fix") {
    try {
      load_idx_split(dir.path.string(), "valid");
      FAIL("no error");
    } catch (const InputError& e) {
      CHECK(contains(e.what(), dir.file("valid-images-idx3-ubyte")));
      CHECK(contains(e.what(), "set data.path"));
    }
    CHECK_THROWS_AS(load_idx_split(dir.file("no_such_dir"), "train"), InputError);
  }
}

TEST_CASE("real Fashion-MNIST test split, when installed") {
  if (!fs::exists(std::string(kDefaultFashionMnistDir) + "/t10k-images-idx3-ubyte.gz")) return;
  Dataset test = load_idx_split(kDefaultFashionMnistDir, "t10k", 10);
  CHECK(test.x.shape() == Shape{10000, 28, 28, 1});
  CHECK(test.y.shape() == Shape{10000});
  std::set<int> labels(test.y.data<std::int32_t>(), test.y.data<std::int32_t>() + 10000);
  CHECK(labels.size() == 10);
  CHECK(*labels.begin() == 0);
  CHECK(*labels.rbegin() == 9);
}

TEST_CASE("the shipped HDF5 subset loads with shapes and classes") {
  const std::string path = std::string(DTRAIN_SOURCE_DIR) + "/data/fashion_mnist_small.h5";
  Dataset train = load_hdf5(path, "train");
  CHECK(train.x.shape() == Shape{2000, 28, 28, 1});
  CHECK(train.x.dtype() == DType::u8);
  CHECK(train.y.shape() == Shape{2000});
  CHECK(train.y.dtype() == DType::i32);
  CHECK(train.num_classes == 10);
  Dataset test = load_hdf5(path, "test");
  CHECK(test.size() == 500);
  std::set<int> labels(test.y.data<std::int32_t>(), test.y.data<std::int32_t>() + 500);
  CHECK(labels == std::set<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});

  // The subset is the head of the real data set, byte for byte.
  if (fs::exists(std::string(kDefaultFashionMnistDir) + "/t10k-images-idx3-ubyte.gz")) {
    Dataset real = load_idx_split(kDefaultFashionMnistDir, "t10k", 10);
    CHECK(std::equal(test.x.data<std::uint8_t>(), test.x.data<std::uint8_t>() + 500 * 784, real.x.data<std::uint8_t>()));
    CHECK(std::equal(test.y.data<std::int32_t>(), test.y.data<std::int32_t>() + 500, real.y.data<std::int32_t>()));
  }
}

namespace {

// Writes /<group>/<name> into an HDF5 file (created when absent).
template <class T>
void h5_write(const std::string& path, const std::string& group, const std::string& name,
              const std::vector<hsize_t>& dims, const std::vector<T>& values, hid_t file_type, hid_t memory_type) {
  hid_t file = fs::exists(path) ? H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT)
                                : H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  REQUIRE(file >= 0);
  hid_t g = H5Lexists(file, group.c_str(), H5P_DEFAULT) > 0 ? H5Gopen2(file, group.c_str(), H5P_DEFAULT)
                                                            : H5Gcreate2(file, group.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  hid_t ds = H5Dcreate2(g, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  REQUIRE(H5Dwrite(ds, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0);
  H5Dclose(ds);
  H5Sclose(space);
  H5Gclose(g);
  H5Fclose(file);
}

std::string hdf5_error(const std::string& path, const std::string& group) {
  try {
    load_hdf5(path, group);
  } catch (const InputError& e) {
    return e.what();
  }
  FAIL("load_hdf5(" << path << ", " << group << ") did not throw InputError");
  return {};
}

}  // namespace

TEST_CASE("load_hdf5 converts types and reports defects by file and dataset") {
  TempDir dir;
  const std::string path = dir.file("d.h5");

  SUBCASE("wide integers that fit become u8; float y becomes (N, 1) targets") {
    h5_write<std::int32_t>(path, "train", "x", {3, 2}, {0, 1, 2, 253, 254, 255}, H5T_STD_I32LE, H5T_NATIVE_INT32);
    h5_write<double>(path, "train", "y", {3}, {0.5, 1.5, -2.0}, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE);
    Dataset ds = load_hdf5(path, "train");
    CHECK(ds.x.dtype() == DType::u8);
    CHECK(ds.x.shape() == Shape{3, 2});
    CHECK(ds.x.data<std::uint8_t>()[5] == 255);
    CHECK(ds.y.dtype() == DType::f32);
    CHECK(ds.y.shape() == Shape{3, 1});
    CHECK(ds.y.data<float>()[2] == -2.0f);
  }
  SUBCASE("integer x outside 0..255 is refused, not clipped") {
    h5_write<std::int32_t>(path, "train", "x", {2}, {1, 300}, H5T_STD_I32LE, H5T_NATIVE_INT32);
    h5_write<std::int32_t>(path, "train", "y", {2}, {0, 1}, H5T_STD_I32LE, H5T_NATIVE_INT32);
    std::string msg = hdf5_error(path, "train");
    CHECK(contains(msg, path));
    CHECK(contains(msg, "/train/x"));
    CHECK(contains(msg, "0..255"));
  }
  SUBCASE("float x stays f32 with scale 1") {
    h5_write<float>(path, "train", "x", {2, 2}, {0.25f, 2.0f, -1.0f, 4.0f}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT);
    h5_write<std::uint8_t>(path, "train", "y", {2}, {1, 0}, H5T_STD_U8LE, H5T_NATIVE_UINT8);
    Dataset ds = load_hdf5(path, "train");
    CHECK(ds.x.dtype() == DType::f32);
    CHECK(ds.x_scale == 1.0f);
    CHECK(ds.num_classes == 2);
  }
  SUBCASE("missing dataset") {
    h5_write<std::uint8_t>(path, "train", "x", {2}, {1, 2}, H5T_STD_U8LE, H5T_NATIVE_UINT8);
    std::string msg = hdf5_error(path, "train");
    CHECK(contains(msg, path));
    CHECK(contains(msg, "/train/y"));
  }
  SUBCASE("missing group") {
    h5_write<std::uint8_t>(path, "train", "x", {2}, {1, 2}, H5T_STD_U8LE, H5T_NATIVE_UINT8);
    CHECK(contains(hdf5_error(path, "test"), "no group /test"));
  }
  SUBCASE("count mismatch") {
    h5_write<std::uint8_t>(path, "train", "x", {3}, {1, 2, 3}, H5T_STD_U8LE, H5T_NATIVE_UINT8);
    h5_write<std::uint8_t>(path, "train", "y", {2}, {1, 2}, H5T_STD_U8LE, H5T_NATIVE_UINT8);
    CHECK(contains(hdf5_error(path, "train"), "holds 3 examples but /train/y holds 2"));
  }
  SUBCASE("not HDF5, missing file") {
    write_plain(path, {'n', 'o', 'p', 'e'});
    CHECK(contains(hdf5_error(path, "train"), "not an HDF5 file"));
    CHECK(contains(hdf5_error(dir.file("absent.h5"), "train"), "no such file"));
  }
}

TEST_CASE("synthetic data is deterministic, split-dependent and learnable") {
  Dataset a = make_synthetic({4, 4, 1}, 4, 200, 7, 0);
  Dataset b = make_synthetic({4, 4, 1}, 4, 100, 7, 0);
  Dataset test = make_synthetic({4, 4, 1}, 4, 100, 7, 1);
  CHECK(a.x.shape() == Shape{200, 4, 4, 1});
  CHECK(a.y.dtype() == DType::i32);
  CHECK(std::equal(b.x.data<std::uint8_t>(), b.x.data<std::uint8_t>() + 1600, a.x.data<std::uint8_t>()));
  CHECK_FALSE(std::equal(test.x.data<std::uint8_t>(), test.x.data<std::uint8_t>() + 1600, a.x.data<std::uint8_t>()));
  // The brightest quarter of the image names the class: a trivial classifier beats chance by far.
  int correct = 0;
  std::set<int> seen;
  for (int i = 0; i < 200; ++i) {
    int best = 0, best_sum = -1;
    for (int c = 0; c < 4; ++c) {
      int sum = 0;
      for (int p = c * 4; p < c * 4 + 4; ++p) sum += a.x.data<std::uint8_t>()[i * 16 + p];
      if (sum > best_sum) best_sum = sum, best = c;
    }
    correct += best == a.y.data<std::int32_t>()[i];
    seen.insert(a.y.data<std::int32_t>()[i]);
  }
  CHECK(seen.size() == 4);
  CHECK(correct > 180);
}

TEST_CASE("make_repeated repeats one example") {
  Dataset ds = make_repeated({1.0, 2.0, 3.0}, {0.5}, 4);
  CHECK(ds.x.shape() == Shape{4, 3});
  CHECK(ds.y.shape() == Shape{4, 1});
  CHECK(ds.x.data<float>()[3 * 3 + 2] == 3.0f);
  CHECK(ds.y.data<float>()[3] == 0.5f);
  CHECK_THROWS_AS(make_repeated({}, {1.0}, 2), ConfigError);
}

TEST_CASE("load_splits: validation_split holds out the last fraction, Keras-style") {
  config::DataConfig cfg;
  cfg.source = config::SourceKind::synthetic;
  cfg.shape = {2, 2, 1};
  cfg.classes = 3;
  cfg.train_size = 10;
  cfg.test_size = 4;
  cfg.validation_split = 0.25;  // floor(10 * 0.75) = 7 stay in train
  DataSplits splits = load_splits(cfg, 5);
  Dataset whole = make_synthetic({2, 2, 1}, 3, 10, 5, 0);
  REQUIRE(splits.validation.has_value());
  CHECK(splits.train.size() == 7);
  CHECK(splits.validation->size() == 3);
  CHECK(splits.test.size() == 4);
  CHECK(std::equal(splits.validation->x.data<std::uint8_t>(), splits.validation->x.data<std::uint8_t>() + 12,
                   whole.x.data<std::uint8_t>() + 7 * 4));
  CHECK(splits.validation->y.data<std::int32_t>()[0] == whole.y.data<std::int32_t>()[7]);
  CHECK(splits.train.y.data<std::int32_t>()[6] == whole.y.data<std::int32_t>()[6]);

  cfg.validation_split = 0.0;
  CHECK_FALSE(load_splits(cfg, 5).validation.has_value());
  cfg.validation_split = 0.01;  // floor(10 * 0.99) = 9: one held out
  CHECK(load_splits(cfg, 5).validation->size() == 1);
  cfg.validation_split = 1.0;
  CHECK_THROWS_AS(load_splits(cfg, 5), ConfigError);

  config::DataConfig tensors;
  tensors.source = config::SourceKind::tensors;
  tensors.x = {1.0, 2.0};
  tensors.y = {3.0};
  tensors.train_size = 6;
  DataSplits t = load_splits(tensors, 0);
  CHECK(t.train.size() == 6);
  CHECK(t.test.size() == 6);

  config::DataConfig hdf5;
  hdf5.source = config::SourceKind::hdf5;
  hdf5.path = std::string(DTRAIN_SOURCE_DIR) + "/data/fashion_mnist_small.h5";
  hdf5.validation_split = 0.1;
  DataSplits h = load_splits(hdf5, 0);
  CHECK(h.train.size() == 1800);
  CHECK(h.validation->size() == 200);
  CHECK(h.test.size() == 500);

  config::DataConfig missing;
  missing.source = config::SourceKind::fashion_mnist;
  missing.path = "/nonexistent/fashion";
  CHECK_THROWS_AS(load_splits(missing, 0), InputError);
}

TEST_CASE("load_splits: with data.shards the last part of all the files' rows together is held out, by any worker") {
  // Files of 10 and 7 rows (x = 100 * file + row), validation_split 0.25: floor(17 * 0.75) = 12
  // stay, the first file's 10 and the second's first 2; its last 5 are held out, whether one
  // process reads both files or two workers read one each (auto_shard: file), as one file of the
  // 17 rows would hold them out (tools/to_hdf5 --shards puts its validation rows last).
  TempDir dir;
  const std::vector<std::string> files = {dir.file("a.h5"), dir.file("b.h5")};
  for (std::size_t f = 0; f < files.size(); ++f) {
    const hsize_t rows = f == 0 ? 10 : 7;
    std::vector<std::int32_t> x(rows), y(rows, 0);
    for (hsize_t i = 0; i < rows; ++i) x[i] = static_cast<std::int32_t>(100 * f + i);
    for (const char* group : {"train", "test"}) {
      h5_write<std::int32_t>(files[f], group, "x", {rows, 1}, x, H5T_STD_I32LE, H5T_NATIVE_INT32);
      h5_write<std::int32_t>(files[f], group, "y", {rows}, y, H5T_STD_I32LE, H5T_NATIVE_INT32);
    }
  }
  config::DataConfig cfg;
  cfg.source = config::SourceKind::hdf5;
  cfg.shards = files;
  cfg.validation_split = 0.25;
  const auto rows_of = [](const Dataset& d) {
    return std::vector<std::uint8_t>(d.x.data<std::uint8_t>(), d.x.data<std::uint8_t>() + d.size());
  };
  const DataSplits both = load_splits(cfg, 0);
  REQUIRE(both.validation.has_value());
  CHECK(rows_of(*both.validation) == std::vector<std::uint8_t>{102, 103, 104, 105, 106});
  CHECK(rows_of(both.train) == std::vector<std::uint8_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 100, 101});
  CHECK(both.test.size() == 17);
  std::vector<std::uint8_t> by_worker;
  for (const std::string& file : files) {
    const DataSplits mine = load_splits(cfg, 0, {file});
    REQUIRE(mine.validation.has_value());
    const auto held = rows_of(*mine.validation);
    by_worker.insert(by_worker.end(), held.begin(), held.end());
  }
  CHECK(by_worker == rows_of(*both.validation));
  // Every row held out (a fraction that keeps none of either file) is still refused.
  cfg.validation_split = 0.95;
  CHECK_THROWS_WITH_AS(load_splits(cfg, 0), doctest::Contains("data.validation_split 0.95 of the 17 training examples "
                                                              "of the 2 shard files leaves 0 for training and 17 for "
                                                              "validation"),
                       ConfigError);
}

TEST_CASE("load_splits: data.shards that name one file twice, by two spellings or through a link, are refused") {
  TempDir dir;
  const std::string a = dir.file("a.h5"), b = dir.file("b.h5");
  for (const std::string& file : {a, b})
    for (const char* group : {"train", "test"}) {
      h5_write<std::int32_t>(file, group, "x", {2, 1}, {1, 2}, H5T_STD_I32LE, H5T_NATIVE_INT32);
      h5_write<std::int32_t>(file, group, "y", {2}, {0, 0}, H5T_STD_I32LE, H5T_NATIVE_INT32);
    }
  const std::string dotted = (fs::path(a).parent_path() / "." / "a.h5").string(), link = dir.file("link.h5");
  fs::create_symlink(a, link);
  config::DataConfig cfg;
  cfg.source = config::SourceKind::hdf5;
  cfg.shards = {a, b};
  CHECK(load_splits(cfg, 0).train.size() == 4);
  for (const std::string& again : {dotted, link}) {
    cfg.shards = {a, b, again};
    const std::string expected = fmt::format("data.shards: '{}' and '{}' are the same file", a, again);
    CHECK_THROWS_WITH_AS(load_splits(cfg, 0), doctest::Contains(expected.c_str()), InputError);
  }
  // A worker reading only b (auto_shard: file) refuses the job too.
  CHECK_THROWS_AS(load_splits(cfg, 0, {b}), InputError);
}

TEST_CASE("non-finite inputs are refused at load, naming the file, the dataset and the first sample") {
  TempDir dir;
  SUBCASE("HDF5: a NaN pixel") {
    const std::string path = dir.file("nan.h5");
    std::vector<float> x(4 * 3, 0.5f);
    x[2 * 3 + 1] = std::numeric_limits<float>::quiet_NaN();  // sample 2
    h5_write<float>(path, "train", "x", {4, 3}, x, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT);
    h5_write<std::int32_t>(path, "train", "y", {4}, {0, 1, 0, 1}, H5T_STD_I32LE, H5T_NATIVE_INT32);
    const std::string msg = hdf5_error(path, "train");
    CHECK(contains(msg, path));
    CHECK(contains(msg, "/train/x sample 2"));
    CHECK(contains(msg, "non-finite"));
  }
  SUBCASE("HDF5: an infinite target") {
    const std::string path = dir.file("inf.h5");
    h5_write<float>(path, "train", "x", {2, 1}, {1.0f, 2.0f}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT);
    h5_write<float>(path, "train", "y", {2}, {0.5f, -std::numeric_limits<float>::infinity()}, H5T_IEEE_F32LE,
                    H5T_NATIVE_FLOAT);
    CHECK_MESSAGE(contains(hdf5_error(path, "train"), "/train/y sample 1"), hdf5_error(path, "train"));
    // Stored as float64, the infinity already fails the conversion to float32: refused, by name.
    const std::string wide = dir.file("inf64.h5");
    h5_write<float>(wide, "train", "x", {2, 1}, {1.0f, 2.0f}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT);
    h5_write<double>(wide, "train", "y", {2}, {0.5, -std::numeric_limits<double>::infinity()}, H5T_IEEE_F64LE,
                     H5T_NATIVE_DOUBLE);
    CHECK_MESSAGE(contains(hdf5_error(wide, "train"), "/train/y holds values outside float32"), hdf5_error(wide, "train"));
  }
  SUBCASE("IDX: float images with a NaN") {
    std::vector<unsigned char> payload;
    for (int i = 0; i < 2 * 2 * 2; ++i) put_be32(payload, i == 5 ? 0x7fc00000u : 0x3f000000u);  // sample 1
    write_plain(dir.file("train-images-idx3-ubyte"), idx_bytes(0x0D, {2, 2, 2}, payload));
    write_plain(dir.file("train-labels-idx1-ubyte"), idx_bytes(0x08, {2}, {0, 1}));
    try {
      load_idx_split(dir.path.string(), "train");
      FAIL("no error");
    } catch (const InputError& e) {
      CHECK(contains(e.what(), dir.file("train-images-idx3-ubyte")));
      CHECK(contains(e.what(), "sample 1"));
    }
  }
}

TEST_CASE("special files are refused before they are opened, instead of blocking") {
  TempDir dir;
  const std::string fifo = dir.file("train-images-idx3-ubyte");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(contains(idx_error(fifo), "not a regular file"));
  CHECK(contains(idx_error(fifo), fifo));
  const std::string h5_fifo = dir.file("d.h5");
  REQUIRE(::mkfifo(h5_fifo.c_str(), 0600) == 0);
  CHECK(contains(hdf5_error(h5_fifo, "train"), "not a regular file"));
  CHECK(contains(idx_error("/dev/zero"), "not a regular file"));
}

// Attribute num_classes = `classes` on `group` of the file at `path`.
void h5_num_classes(const std::string& path, const std::string& group, long long classes) {
  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  REQUIRE(file >= 0);
  hid_t g = H5Gopen2(file, group.c_str(), H5P_DEFAULT);
  hid_t space = H5Screate(H5S_SCALAR);
  hid_t attr = H5Acreate2(g, "num_classes", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
  REQUIRE(H5Awrite(attr, H5T_NATIVE_LLONG, &classes) >= 0);
  H5Aclose(attr);
  H5Sclose(space);
  H5Gclose(g);
  H5Fclose(file);
}

TEST_CASE("a label below 0 or past num_classes, and a num_classes out of range, are refused saying which") {
  TempDir dir;
  const std::string path = dir.file("d.h5");
  h5_write<std::uint8_t>(path, "train", "x", {3}, {1, 2, 3}, H5T_STD_U8LE, H5T_NATIVE_UINT8);
  SUBCASE("a negative label, no class count declared") {
    h5_write<std::int32_t>(path, "train", "y", {3}, {0, -1, 1}, H5T_STD_I32LE, H5T_NATIVE_INT32);
    const std::string msg = hdf5_error(path, "train");
    CHECK(contains(msg, "/train/y: label -1 at index 1 is negative; class ids count from 0"));
    CHECK(!contains(msg, "2147483647"));
  }
  SUBCASE("a label past the declared class count") {
    h5_write<std::int32_t>(path, "train", "y", {3}, {0, 3, 1}, H5T_STD_I32LE, H5T_NATIVE_INT32);
    h5_num_classes(path, "train", 3);
    CHECK(contains(hdf5_error(path, "train"), "label 3 at index 1 is outside 0..2, the 3 classes declared"));
  }
  SUBCASE("a class count past int32") {
    h5_write<std::int32_t>(path, "train", "y", {3}, {0, 1, 1}, H5T_STD_I32LE, H5T_NATIVE_INT32);
    h5_num_classes(path, "train", 1LL << 40);
    CHECK(contains(hdf5_error(path, "train"), "is 1099511627776; it must lie in 1..2147483647"));
  }
}

TEST_CASE("train and test splits that declare different num_classes are refused, naming both") {
  TempDir dir;
  const auto make = [&](const std::string& name, std::optional<long long> train, std::optional<long long> test) {
    const std::string path = dir.file(name);
    for (const char* group : {"train", "test"}) {
      h5_write<std::uint8_t>(path, group, "x", {2, 2}, {1, 2, 3, 4}, H5T_STD_U8LE, H5T_NATIVE_UINT8);
      h5_write<std::int32_t>(path, group, "y", {2}, {0, 1}, H5T_STD_I32LE, H5T_NATIVE_INT32);
    }
    if (train) h5_num_classes(path, "train", *train);
    if (test) h5_num_classes(path, "test", *test);
    config::DataConfig config;
    config.source = config::SourceKind::hdf5;
    config.path = path;
    return config;
  };
  try {
    load_splits(make("differ.h5", 3, 5), 1);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(contains(e.what(), "declares 3 classes but HDF5 /test"));
    CHECK(contains(e.what(), "declares 5; the splits must declare the same num_classes"));
  }
  CHECK(load_splits(make("same.h5", 4, 4), 1).test.num_classes == 4);
  // One declared, one counted from its labels: the larger, as a split may lack the top class.
  const DataSplits one = load_splits(make("one.h5", 4, std::nullopt), 1);
  CHECK(one.train.num_classes == 4);
  CHECK(one.test.num_classes == 4);
  CHECK(!one.train.classes_from_labels);
  CHECK(load_splits(make("none.h5", std::nullopt, std::nullopt), 1).train.classes_from_labels);
  // Float targets' widths are not classes: splits of other widths are told apart as targets.
  const std::string widths = dir.file("widths.h5");
  for (const auto& [group, width] : {std::pair{"train", 2}, std::pair{"test", 3}}) {
    h5_write<std::uint8_t>(widths, group, "x", {2, 2}, {1, 2, 3, 4}, H5T_STD_U8LE, H5T_NATIVE_UINT8);
    h5_write<float>(widths, group, "y", {2, static_cast<hsize_t>(width)}, std::vector<float>(2 * width, 0.5f),
                    H5T_IEEE_F32LE, H5T_NATIVE_FLOAT);
  }
  config::DataConfig config;
  config.source = config::SourceKind::hdf5;
  config.path = widths;
  try {
    load_splits(config, 1);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(!contains(e.what(), "num_classes"));
    CHECK(contains(e.what(), "targets"));
  }
}

TEST_CASE("float targets outside [0, 1] are found for a crossentropy, naming the source and the sample") {
  DataSplits splits;
  splits.train.x = Tensor(Shape{3, 2}, DType::f32);
  splits.train.y = Tensor(Shape{3, 2}, DType::f32);
  splits.train.labels_source = "d.h5 /train/y";
  splits.train.first_row = 10;
  float* y = splits.train.y.data<float>();
  for (int i = 0; i < 6; ++i) y[i] = 0.25f * static_cast<float>(i % 5);  // 0 .. 1
  splits.test = splits.train;
  check_probability_targets(splits, "binary_crossentropy");  // fits
  y[5] = 1.5f;
  try {
    check_probability_targets(splits, "binary_crossentropy");
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()) ==
          "d.h5 /train/y: target 1.5 of sample 12 is outside [0, 1]; loss binary_crossentropy reads float targets as "
          "probabilities: scale the targets into [0, 1], or use mean_squared_error for values");
  }
  y[5] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(check_probability_targets(splits, "categorical_crossentropy"), InputError);
  // Integer labels are check_label_range's.
  splits.train.y = Tensor(Shape{3}, DType::i32);
  splits.test = splits.train;
  splits.train.y.data<std::int32_t>()[0] = 7;
  check_probability_targets(splits, "binary_crossentropy");
}

TEST_CASE("labels outside the model's classes are found at load, naming the file and the sample") {
  TempDir dir;
  write_idx_split(dir, "train", 12, 2, 2, 4, /*gz=*/false);
  write_idx_split(dir, "t10k", 5, 2, 2, 4, /*gz=*/false);
  std::vector<unsigned char> labels(12, 1);
  labels[7] = 200;
  write_plain(dir.file("train-labels-idx1-ubyte"), idx_bytes(0x08, {12}, labels));
  config::DataConfig config;
  config.source = config::SourceKind::idx;
  config.path = dir.path.string();
  DataSplits splits = load_splits(config, 1);
  check_label_range(splits, 201);  // fits
  try {
    check_label_range(splits, 10);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(contains(e.what(), dir.file("train-labels-idx1-ubyte")));
    CHECK(contains(e.what(), "label 200 of sample 7"));
  }
  // A validation split names the file's row, not the split's.
  config.validation_split = 0.5;
  splits = load_splits(config, 1);
  try {
    check_label_range(splits, 10);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(contains(e.what(), "label 200 of sample 7"));
  }
}
