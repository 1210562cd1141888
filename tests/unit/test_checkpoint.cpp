// Checkpoint files and the CheckpointManager: exact round trips, every refusal a bad file must
// produce (with the model and optimizer left untouched), atomic replacement and retention.
#include <doctest/doctest.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/manager.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "nn/conv2d.hpp"
#include "nn/dense.hpp"
#include "nn/registry.hpp"
#include "nn/reshape.hpp"
#include "test_support.hpp"

using namespace dtrain;
namespace fs = std::filesystem;
namespace ckpt = dtrain::checkpoint;

namespace {

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() / fmt::format("dtrain_test_checkpoint_{}_{}", ::getpid(), counter++);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// (6, 6, 1) -> conv2d 3x3x2 -> (4, 4, 2) -> flatten (32) -> dense (units) [-> dense_1 (extra_units)]
config::ModelConfig model_config(int dense_units = 3, int extra_units = 0, bool with_dense = true) {
  config::ModelConfig mc;
  mc.input_shape = {6, 6, 1};
  nn::Conv2DOptions conv;
  conv.filters = 2;
  mc.layers.push_back(nn::layer_config("conv2d", conv));
  mc.layers.push_back(nn::layer_config("flatten", nn::FlattenOptions{}));
  if (with_dense) {
    nn::DenseOptions dense;
    dense.units = dense_units;
    mc.layers.push_back(nn::layer_config("dense", dense));
  }
  if (extra_units > 0) {
    nn::DenseOptions dense;
    dense.units = extra_units;
    mc.layers.push_back(nn::layer_config("dense_1", dense));
  }
  return mc;
}

std::unique_ptr<optim::Optimizer> make_optimizer(config::OptimizerKind kind = config::OptimizerKind::adam,
                                                 double momentum = 0.0) {
  config::OptimizerConfig c;
  c.kind = kind;
  c.momentum = momentum;
  return optim::make_optimizer(c, testing::cpu_numerics());
}

// One update with pseudo-random gradients, so weights and slots are all non-zero.
void step(nn::Sequential& model, optim::Optimizer& optimizer, std::uint64_t seed) {
  Rng rng(seed, RngStream::test);
  for (Variable* v : model.variables()) {
    for (float& g : v->grad.span<float>()) g = rng.uniform(-1.0f, 1.0f);
  }
  optimizer.apply_gradients(model.variables());
}

ckpt::Contents sample_contents() {
  ckpt::Contents c;
  c.state.epoch = 3;
  c.state.step_in_epoch = 17;
  c.state.global_step = 1234;
  c.state.seed = 0xfedcba9876543210ULL;
  c.state.epoch_loss_sum = 12.345678901234567;
  c.state.epoch_samples = 1088;
  c.state.metric_counts = {{1000, 1088}, {}};
  c.state.metric_sums = {{0.25, -1.5e300}, {3.0}};
  c.experiment_yaml = "name: test\nseed: 42\nmodel:\n  input_shape: [6, 6, 1]\n";
  c.dtrain_version = "0.1.0-test";
  return c;
}

std::vector<std::vector<float>> weights(const nn::Sequential& model) {
  std::vector<std::vector<float>> out;
  for (const Variable* v : model.variables()) {
    auto s = v->value.span<float>();
    out.emplace_back(s.begin(), s.end());
  }
  return out;
}

std::vector<std::vector<float>> slots(const optim::Optimizer& optimizer) {
  std::vector<std::vector<float>> out;
  for (std::size_t i = 0; i < optimizer.num_variables(); ++i) {
    for (std::size_t s = 0; s < optimizer.slot_names().size(); ++s) {
      auto span = optimizer.slot(i, s).span<float>();
      out.emplace_back(span.begin(), span.end());
    }
  }
  return out;
}

bool bitwise_equal(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

// Writes a trained model (seed 1, two Adam steps) to `path`; returns its weights.
std::vector<std::vector<float>> write_sample(const std::string& path) {
  nn::Sequential model(model_config(), 1, testing::cpu());
  auto optimizer = make_optimizer();
  step(model, *optimizer, 10);
  step(model, *optimizer, 11);
  ckpt::save(path, model, *optimizer, sample_contents());
  return weights(model);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no InputError)";
}

std::uint64_t data_offset(const std::string& path, const std::string& dataset) {
  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  REQUIRE(file >= 0);
  hid_t ds = H5Dopen2(file, dataset.c_str(), H5P_DEFAULT);
  REQUIRE(ds >= 0);
  const haddr_t offset = H5Dget_offset(ds);
  H5Dclose(ds);
  H5Fclose(file);
  REQUIRE(offset != HADDR_UNDEF);
  return offset;
}

void flip_byte(const std::string& path, std::uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
  REQUIRE(f);
}

// Drops the user block holding the whole-file checksum: the file is then laid out as an older
// dtrain wrote it (HDF5's signature at byte 0; HDF5 addresses are relative to it).
void remove_seal(const std::string& path) {
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  REQUIRE(bytes.size() > ckpt::kSealBytes);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data() + ckpt::kSealBytes, static_cast<std::streamsize>(bytes.size() - ckpt::kSealBytes));
  REQUIRE(out);
}

std::vector<std::string> temporaries_in(const fs::path& dir) {
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.find(".tmp-") != std::string::npos) found.push_back(name);
  }
  return found;
}

}  // namespace

TEST_CASE("checkpoint: save and restore round-trip bit for bit") {
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  nn::Sequential model(model_config(), 1, testing::cpu());
  auto optimizer = make_optimizer();
  step(model, *optimizer, 10);
  step(model, *optimizer, 11);
  const ckpt::Contents contents = sample_contents();
  ckpt::save(path, model, *optimizer, contents);

  nn::Sequential restored(model_config(), 2, testing::cpu());
  auto restored_optimizer = make_optimizer();
  REQUIRE_FALSE(bitwise_equal(weights(restored), weights(model)));
  const ckpt::Contents read = ckpt::restore(path, restored, *restored_optimizer);
  CHECK(read == contents);
  CHECK(bitwise_equal(weights(restored), weights(model)));
  CHECK(bitwise_equal(slots(*restored_optimizer), slots(*optimizer)));
  CHECK(restored_optimizer->iterations() == 2);

  // Continuing from the checkpoint is the same as never stopping.
  step(model, *optimizer, 12);
  step(restored, *restored_optimizer, 12);
  CHECK(bitwise_equal(weights(restored), weights(model)));
  CHECK(bitwise_equal(slots(*restored_optimizer), slots(*optimizer)));
}

TEST_CASE("checkpoint: an optimizer without slots and one never stepped round-trip") {
  TempDir dir;
  nn::Sequential model(model_config(), 1, testing::cpu());
  auto sgd = make_optimizer(config::OptimizerKind::sgd);
  REQUIRE(sgd->slot_names().empty());
  step(model, *sgd, 3);
  ckpt::save(dir.file("sgd.h5"), model, *sgd, {});
  nn::Sequential restored(model_config(), 2, testing::cpu());
  auto restored_sgd = make_optimizer(config::OptimizerKind::sgd);
  const ckpt::Contents read = ckpt::restore(dir.file("sgd.h5"), restored, *restored_sgd);
  CHECK(read == ckpt::Contents{});
  CHECK(bitwise_equal(weights(restored), weights(model)));
  CHECK(restored_sgd->iterations() == 1);

  // Saved before its first update, Adam's slots are the zeros build() makes.
  auto fresh = make_optimizer();
  ckpt::save(dir.file("fresh.h5"), model, *fresh, {});
  auto restored_fresh = make_optimizer();
  ckpt::restore(dir.file("fresh.h5"), restored, *restored_fresh);
  CHECK(restored_fresh->built());
  CHECK(restored_fresh->iterations() == 0);
  for (const auto& slot : slots(*restored_fresh)) {
    for (float x : slot) CHECK(x == 0.0f);
  }
}

TEST_CASE("checkpoint: peek and restore_model") {
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  const auto saved = write_sample(path);
  CHECK(ckpt::peek(path) == sample_contents());

  nn::Sequential model(model_config(), 5, testing::cpu());
  CHECK(ckpt::restore_model(path, model) == sample_contents());
  CHECK(bitwise_equal(weights(model), saved));
}

TEST_CASE("checkpoint: the whole-file checksum refuses any changed byte before HDF5 reads the file") {
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  write_sample(path);
  CHECK(ckpt::verify_seal(path) == std::optional<bool>(true));
  const auto size = fs::file_size(path);
  for (std::uintmax_t at : {std::uintmax_t{ckpt::kSealBytes}, std::uintmax_t{ckpt::kSealBytes + 97}, size / 2, size - 1}) {
    CAPTURE(at);
    const std::string changed = dir.file("changed.h5");
    fs::copy_file(path, changed, fs::copy_options::overwrite_existing);
    flip_byte(changed, at);
    CHECK(ckpt::verify_seal(changed) == std::optional<bool>(false));
    nn::Sequential model(model_config(), 2, testing::cpu());
    auto optimizer = make_optimizer();
    const auto before = weights(model);
    const std::string message = error_of([&] { ckpt::restore(changed, model, *optimizer); });
    CHECK(message.find("whole-file checksum mismatch") != std::string::npos);
    CHECK(message.find(changed) != std::string::npos);
    CHECK(bitwise_equal(weights(model), before));
  }
  // Without the seal (a file from an older dtrain) the file still reads, by its per-dataset checks.
  remove_seal(path);
  CHECK_FALSE(ckpt::verify_seal(path).has_value());
  CHECK(ckpt::peek(path) == sample_contents());
}

TEST_CASE("checkpoint: a flipped byte in an unsealed file is a per-dataset checksum error and changes nothing") {
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  write_sample(path);
  remove_seal(path);  // so that the per-dataset checks, not the whole-file one, meet the flip

  SUBCASE("in a weight") {
    flip_byte(path, data_offset(path, "/model/dense/kernel") + 7);
    nn::Sequential model(model_config(), 2, testing::cpu());
    auto optimizer = make_optimizer();
    const auto before = weights(model);
    const std::string message = error_of([&] { ckpt::restore(path, model, *optimizer); });
    CHECK(message.find("checksum") != std::string::npos);
    CHECK(message.find("/model/dense/kernel") != std::string::npos);
    CHECK(message.find(path) != std::string::npos);
    CHECK(bitwise_equal(weights(model), before));
    CHECK_FALSE(optimizer->built());
  }
  SUBCASE("in an optimizer slot, after the weights verified") {
    flip_byte(path, data_offset(path, "/optimizer/v/dense/bias"));
    nn::Sequential model(model_config(), 2, testing::cpu());
    auto optimizer = make_optimizer();
    step(model, *optimizer, 99);
    const auto before = weights(model);
    const auto slots_before = slots(*optimizer);
    const std::string message = error_of([&] { ckpt::restore(path, model, *optimizer); });
    CHECK(message.find("checksum mismatch in /optimizer/v/dense/bias") != std::string::npos);
    CHECK(bitwise_equal(weights(model), before));
    CHECK(bitwise_equal(slots(*optimizer), slots_before));
    CHECK(optimizer->iterations() == 1);
  }
  SUBCASE("in the state") {
    flip_byte(path, data_offset(path, "/state/global_step"));
    CHECK(error_of([&] { ckpt::peek(path); }).find("checksum mismatch in /state/global_step") != std::string::npos);
  }
  SUBCASE("in the experiment") {
    flip_byte(path, data_offset(path, "/experiment") + 3);
    CHECK(error_of([&] { ckpt::peek(path); }).find("checksum mismatch in /experiment") != std::string::npos);
  }
}

TEST_CASE("checkpoint: truncated, foreign and missing files are clean InputErrors") {
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  write_sample(path);
  const auto size = fs::file_size(path);
  nn::Sequential model(model_config(), 2, testing::cpu());
  auto optimizer = make_optimizer();
  const auto before = weights(model);

  for (std::uintmax_t cut : {std::uintmax_t{0}, std::uintmax_t{7}, std::uintmax_t{100}, size / 4, size / 2, size - 1}) {
    CAPTURE(cut);
    const std::string truncated = dir.file("truncated.h5");
    fs::copy_file(path, truncated, fs::copy_options::overwrite_existing);
    fs::resize_file(truncated, cut);
    const std::string message = error_of([&] { ckpt::restore(truncated, model, *optimizer); });
    CHECK(message.find("not a readable HDF5 checkpoint (truncated or corrupt)") != std::string::npos);
    CHECK(message.find(truncated) != std::string::npos);
  }
  CHECK(bitwise_equal(weights(model), before));

  const std::string text = dir.file("notes.h5");
  std::ofstream(text) << "this is not an HDF5 file\n";
  CHECK(error_of([&] { ckpt::peek(text); }).find("not a readable HDF5 checkpoint") != std::string::npos);
  CHECK(error_of([&] { ckpt::peek(dir.file("absent.h5")); }).find("no such checkpoint file") != std::string::npos);
  CHECK(error_of([&] { ckpt::peek(dir.path().string()); }).find("is a directory") != std::string::npos);
}

TEST_CASE("checkpoint: another model, format version or optimizer is refused by name") {
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  write_sample(path);

  SUBCASE("another dense size") {
    nn::Sequential model(model_config(5), 2, testing::cpu());
    auto optimizer = make_optimizer();
    const auto before = weights(model);
    const std::string message = error_of([&] { ckpt::restore(path, model, *optimizer); });
    CHECK(message.find("variable /model/dense/kernel has shape (32, 3), the model expects (32, 5)") !=
          std::string::npos);
    CHECK(bitwise_equal(weights(model), before));
  }
  SUBCASE("a variable the checkpoint lacks") {
    nn::Sequential model(model_config(3, 4), 2, testing::cpu());
    const std::string message = error_of([&] { ckpt::restore_model(path, model); });
    CHECK(message.find("missing variable /model/dense_1/kernel of shape (3, 4)") != std::string::npos);
  }
  SUBCASE("a variable the model lacks") {
    nn::Sequential model(model_config(3, 0, false), 2, testing::cpu());
    const std::string message = error_of([&] { ckpt::restore_model(path, model); });
    CHECK(message.find("/model/dense/") != std::string::npos);
    CHECK(message.find("not in the model") != std::string::npos);
  }
  SUBCASE("another format version") {
    remove_seal(path);
    hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    REQUIRE(file >= 0);
    hid_t attr = H5Aopen(file, "format_version", H5P_DEFAULT);
    REQUIRE(attr >= 0);
    const int version = 7;
    REQUIRE(H5Awrite(attr, H5T_NATIVE_INT, &version) >= 0);
    H5Aclose(attr);
    H5Fclose(file);
    const std::string message = error_of([&] { ckpt::peek(path); });
    CHECK(message.find("format version 7 (this dtrain reads 1)") != std::string::npos);
  }
  SUBCASE("another optimizer kind") {
    nn::Sequential model(model_config(), 2, testing::cpu());
    auto sgd = make_optimizer(config::OptimizerKind::sgd);
    const auto before = weights(model);
    const std::string message = error_of([&] { ckpt::restore(path, model, *sgd); });
    CHECK(message.find("optimizer mismatch (checkpoint has adam, the experiment sgd)") != std::string::npos);
    CHECK(bitwise_equal(weights(model), before));
    CHECK(sgd->iterations() == 0);
    // restore_model does not care about the optimizer.
    CHECK_NOTHROW(ckpt::restore_model(path, model));
  }
  SUBCASE("the same kind with other slots") {
    nn::Sequential model(model_config(), 1, testing::cpu());
    auto plain = make_optimizer(config::OptimizerKind::sgd);
    ckpt::save(path, model, *plain, {});
    auto with_momentum = make_optimizer(config::OptimizerKind::sgd, 0.9);
    REQUIRE_FALSE(with_momentum->slot_names().empty());
    CHECK(error_of([&] { ckpt::restore(path, model, *with_momentum); }).find("optimizer mismatch") !=
          std::string::npos);
  }
}

TEST_CASE("checkpoint: saving replaces a file atomically and leaves no temporary") {
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  write_sample(path);
  nn::Sequential other(model_config(), 3, testing::cpu());
  auto optimizer = make_optimizer();
  step(other, *optimizer, 4);
  ckpt::save(path, other, *optimizer, {});
  CHECK(temporaries_in(dir.path()).empty());
  nn::Sequential restored(model_config(), 2, testing::cpu());
  auto restored_optimizer = make_optimizer();
  CHECK(ckpt::restore(path, restored, *restored_optimizer) == ckpt::Contents{});
  CHECK(bitwise_equal(weights(restored), weights(other)));

  // A failing save (here: the target is a directory) throws IoError and cleans up after itself.
  fs::create_directories(dir.file("occupied"));
  fs::path blocker = dir.path() / "occupied" / "keep";
  std::ofstream(blocker) << "x";
  CHECK_THROWS_AS(ckpt::save(dir.file("occupied"), other, *optimizer, {}), IoError);
  CHECK_THROWS_AS(ckpt::save(dir.file("no/such/dir/ckpt.h5"), other, *optimizer, {}), IoError);
  CHECK(temporaries_in(dir.path()).empty());
  CHECK(fs::exists(blocker));
}

TEST_CASE("checkpoint manager: keeps the newest max_to_keep, recorded in the manifest") {
  TempDir dir;
  const std::string run = dir.file("run");
  nn::Sequential model(model_config(), 1, testing::cpu());
  auto optimizer = make_optimizer();
  {
    ckpt::CheckpointManager manager(run, 2);
    CHECK(fs::is_directory(run));
    CHECK(manager.checkpoints().empty());
    CHECK_FALSE(manager.latest().has_value());
    CHECK(ckpt::list_checkpoints(run).empty());
    for (std::int64_t s : {10, 20, 30, 40}) {
      step(model, *optimizer, static_cast<std::uint64_t>(s));
      ckpt::Contents contents;
      contents.state.global_step = s;
      CHECK(manager.save(s, model, *optimizer, contents) == (fs::path(run) / fmt::format("ckpt-{}.h5", s)).string());
    }
    const std::vector<std::string> expected = {(fs::path(run) / "ckpt-30.h5").string(),
                                               (fs::path(run) / "ckpt-40.h5").string()};
    CHECK(manager.checkpoints() == expected);
    CHECK(ckpt::list_checkpoints(run) == expected);
    CHECK(manager.latest() == expected.back());
    CHECK_FALSE(fs::exists(fs::path(run) / "ckpt-10.h5"));
    CHECK_FALSE(fs::exists(fs::path(run) / "ckpt-20.h5"));
    std::ifstream manifest(fs::path(run) / "checkpoint");
    std::string text((std::istreambuf_iterator<char>(manifest)), std::istreambuf_iterator<char>());
    CHECK(text == "ckpt-30.h5\nckpt-40.h5\n");
    CHECK(ckpt::peek(*manager.latest()).state.global_step == 40);
    CHECK(temporaries_in(run).empty());
  }

  // A process killed mid-write leaves temporaries and an unrecorded file behind.
  std::ofstream(fs::path(run) / "ckpt-50.h5.tmp-12345") << "partial";
  std::ofstream(fs::path(run) / "checkpoint.tmp-999") << "partial";
  fs::copy_file(fs::path(run) / "ckpt-40.h5", fs::path(run) / "ckpt-60.h5");
  ckpt::CheckpointManager manager(run, 2);
  CHECK(temporaries_in(run).empty());
  CHECK(manager.latest() == (fs::path(run) / "ckpt-40.h5").string());

  // Saving an older step again (a run resumed from it) lists it once, in step order, and prunes
  // nothing newer.
  manager.save(30, model, *optimizer, {});
  CHECK(manager.checkpoints() ==
        std::vector<std::string>{(fs::path(run) / "ckpt-30.h5").string(), (fs::path(run) / "ckpt-40.h5").string()});
  manager.save(20, model, *optimizer, {});
  CHECK(manager.checkpoints() == std::vector<std::string>{(fs::path(run) / "ckpt-20.h5").string(),
                                                          (fs::path(run) / "ckpt-30.h5").string(),
                                                          (fs::path(run) / "ckpt-40.h5").string()});
  manager.save(50, model, *optimizer, {});
  CHECK(manager.checkpoints() ==
        std::vector<std::string>{(fs::path(run) / "ckpt-40.h5").string(), (fs::path(run) / "ckpt-50.h5").string()});

  CHECK_THROWS_AS(ckpt::CheckpointManager(dir.file("other"), 0), ConfigError);
  // A line that is no checkpoint name makes the manifest unusable: the directory is used instead.
  std::ofstream(fs::path(run) / "checkpoint") << "ckpt-40.h5\n../elsewhere.h5\n";
  std::string warning;
  CHECK(ckpt::list_checkpoints(run, &warning).back() == (fs::path(run) / "ckpt-60.h5").string());
  CHECK(warning.find("line 2 is not a checkpoint file name") != std::string::npos);
}

TEST_CASE("checkpoint manager: a damaged manifest never hides, reorders or deletes a checkpoint") {
  TempDir dir;
  const std::string run = dir.file("run");
  nn::Sequential model(model_config(), 1, testing::cpu());
  auto optimizer = make_optimizer();
  ckpt::CheckpointManager manager(run, 3);
  for (std::int64_t s : {10, 20, 30}) manager.save(s, model, *optimizer, {});
  const fs::path manifest = fs::path(run) / "checkpoint";
  const auto path = [&](int step) { return (fs::path(run) / fmt::format("ckpt-{}.h5", step)).string(); };
  const std::vector<std::string> all = {path(10), path(20), path(30)};
  const auto listed = [&](std::string& warning) { return ckpt::list_checkpoints(run, &warning); };

  SUBCASE("empty, garbage, deleted or a FIFO: the directory's files, with a warning") {
    for (const std::string& text : {std::string(), std::string("\x01\xff garbage\n"), std::string("-")}) {
      CAPTURE(text);
      fs::remove(manifest);
      if (text != "-") std::ofstream(manifest) << text;
      std::string warning;
      CHECK(listed(warning) == all);
      CHECK(warning.find(manifest.string()) != std::string::npos);
    }
    fs::remove(manifest);
    REQUIRE(::mkfifo(manifest.c_str(), 0600) == 0);
    std::string warning;
    CHECK(listed(warning) == all);  // and no hang
    CHECK(warning.find("not a regular file") != std::string::npos);
    fs::remove(manifest);
  }
  SUBCASE("reversed: ordered by step, newest last") {
    std::ofstream(manifest) << "ckpt-30.h5\nckpt-20.h5\nckpt-10.h5\n";
    std::string warning;
    CHECK(listed(warning) == all);
    CHECK(warning.empty());
    manager.save(40, model, *optimizer, {});
    CHECK(manager.checkpoints() == std::vector<std::string>{path(20), path(30), path(40)});
    CHECK(fs::exists(path(30)));
  }
  SUBCASE("a FIFO, a link to nothing or to a device in place of a listed checkpoint: skipped, with a warning") {
    // The manifest lists them three times, and the directory scan finds them again: one note each.
    std::ofstream(manifest) << "ckpt-10.h5\nckpt-20.h5\nckpt-30.h5\nckpt-30.h5\nckpt-30.h5\n";
    fs::remove(path(30));
    REQUIRE(::mkfifo(path(30).c_str(), 0600) == 0);
    std::string warning;
    CHECK(listed(warning) == std::vector<std::string>{path(10), path(20)});  // and no hang
    CHECK(warning == path(30) + " is a FIFO, not a checkpoint file: skipped");
    fs::remove(path(20));
    fs::create_symlink(path(20) + ".absent", path(20));
    fs::remove(path(10));
    fs::create_symlink("/dev/null", path(10));
    CHECK(listed(warning).empty());
    for (const std::string& note : {path(10) + " is a symbolic link to a device", path(20) + " is a symbolic link to nothing",
                                    path(30) + " is a FIFO"}) {
      CHECK_MESSAGE(warning.find(note + ", not a checkpoint file: skipped") != std::string::npos, warning);
      CHECK(warning.find(note) == warning.rfind(note));
    }
    // A link to a checkpoint is one: read through the link, without a word.
    fs::remove(path(20));
    manager.save(25, model, *optimizer, {});
    fs::rename(path(25), dir.file("elsewhere.h5"));
    fs::create_symlink(dir.file("elsewhere.h5"), path(20));
    std::ofstream(manifest) << "ckpt-20.h5\n";
    CHECK(listed(warning) == std::vector<std::string>{path(20)});
    CHECK(warning.empty());
  }
  SUBCASE("one file listed three times: listed once, and a save keeps it") {
    std::ofstream(manifest) << "ckpt-10.h5\nckpt-30.h5\nckpt-30.h5\nckpt-30.h5\n";
    std::string warning;
    CHECK(listed(warning) == std::vector<std::string>{path(10), path(30)});
    manager.save(40, model, *optimizer, {});
    CHECK(fs::exists(path(30)));
    CHECK(manager.checkpoints() == std::vector<std::string>{path(10), path(30), path(40)});
  }
}

TEST_CASE("checkpoint manager: an unwritable directory is an IoError when the manager opens it") {
  // Root ignores permissions; /proc refuses new files whoever asks.
  CHECK_THROWS_AS(ckpt::CheckpointManager("/proc/self", 1), IoError);
  TempDir dir;
  std::ofstream(dir.file("file")) << "x";
  CHECK_THROWS_AS(ckpt::CheckpointManager(dir.file("file/sub"), 1), IoError);
}

TEST_CASE("checkpoint: /state values no run can reach are refused as corrupt") {
  TempDir dir;
  nn::Sequential model(model_config(), 1, testing::cpu());
  auto optimizer = make_optimizer();
  const auto refused = [&](const std::function<void(ckpt::TrainingState&)>& change, const std::string& part) {
    ckpt::Contents c = sample_contents();
    change(c.state);
    const std::string path = dir.file("state.h5");
    ckpt::save(path, model, *optimizer, c);
    const std::string message = error_of([&] { ckpt::peek(path); });
    CHECK_MESSAGE(message.find(part) != std::string::npos, message);
    CHECK(message.find(path) != std::string::npos);
  };
  refused([](auto& s) { s.global_step = std::numeric_limits<std::int64_t>::max(); }, "global_step 9223372036854775807");
  refused([](auto& s) { s.epoch = std::int64_t{1} << 62; }, "epoch 4611686018427387904");
  refused([](auto& s) { s.epoch = -1; }, "impossible values");
  refused([](auto& s) { s.epoch_samples = std::numeric_limits<std::int64_t>::max(); }, "epoch_samples 9223372036854775807");
  refused([](auto& s) { s.step_in_epoch = s.global_step + 1; }, "impossible values");
  refused([](auto& s) { s.epoch_loss_sum = std::numeric_limits<double>::quiet_NaN(); }, "epoch_loss_sum nan");
  refused([](auto& s) { s.metric_counts[0][1] = -3; }, "/state/metrics/0/counts holds a negative count");
}

TEST_CASE("checkpoint: NaN or infinite weights and slots are refused by name, whatever the checksums say") {
  // A diverged run's values (or a file resealed around them) pass every checksum; restoring them
  // would only make evaluation report NaN and training go on from garbage.
  TempDir dir;
  const std::string path = dir.file("nonfinite.h5");
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  {
    nn::Sequential model(model_config(), 1, testing::cpu());
    auto optimizer = make_optimizer();
    step(model, *optimizer, 10);
    auto kernel = model.variables()[0]->value.span<float>();
    kernel[1] = nan;
    kernel[4] = inf;
    kernel[5] = -inf;
    ckpt::save(path, model, *optimizer, sample_contents());
  }
  REQUIRE(ckpt::verify_seal(path) == std::optional<bool>(true));
  nn::Sequential model(model_config(), 2, testing::cpu());
  auto optimizer = make_optimizer();
  const std::string name = "/model/" + model.variables()[0]->name;
  const std::string expected = name + " holds 3 non-finite values (NaN or infinity; the first at flat index 1)";
  for (const std::string& message : {error_of([&] { ckpt::restore_model(path, model); }),
                                     error_of([&] { ckpt::restore(path, model, *optimizer); })}) {
    CHECK_MESSAGE(message.find(path + ": " + expected) != std::string::npos, message);
  }
  CHECK(ckpt::peek(path) == sample_contents());  // what peek reads is fine

  // An optimizer slot: refused by restore; restore_model (eval) does not read the slots.
  {
    nn::Sequential written(model_config(), 1, testing::cpu());
    auto stepped = make_optimizer();
    step(written, *stepped, 10);
    stepped->slot(1, 1).span<float>()[0] = nan;
    ckpt::save(path, written, *stepped, sample_contents());
  }
  const std::string slot = "/optimizer/" + optimizer->slot_names()[1] + "/" + model.trainable_variables()[1]->name;
  const std::string message = error_of([&] { ckpt::restore(path, model, *optimizer); });
  CHECK_MESSAGE(message.find(slot + " holds 1 non-finite value (") != std::string::npos, message);
  CHECK_NOTHROW(ckpt::restore_model(path, model));
}

TEST_CASE("checkpoint: an optimizer update count past what any run reaches is refused") {
  TempDir dir;
  const std::string path = dir.file("iterations.h5");
  nn::Sequential model(model_config(), 1, testing::cpu());
  auto optimizer = make_optimizer();
  step(model, *optimizer, 10);
  optimizer->set_iterations(ckpt::kMaxGlobalStep + 1);
  ckpt::save(path, model, *optimizer, sample_contents());
  auto restored = make_optimizer();
  const std::string message = error_of([&] { ckpt::restore(path, model, *restored); });
  CHECK_MESSAGE(message.find(path + ": /optimizer has no valid iterations attribute (a count of updates from 0 to "
                                    "4611686018427387904, not 4611686018427387905)") != std::string::npos,
                message);
}

TEST_CASE("checkpoint: a crc32 attribute that is not a single integer is refused, never read past") {
  // The fuzz harness rewrote one as an array (and resealed the file): reading it overran the
  // single value it was read into (AddressSanitizer: stack-buffer-overflow in H5Aread).
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  write_sample(path);
  remove_seal(path);
  {
    hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    REQUIRE(file >= 0);
    hid_t ds = H5Dopen2(file, "/optimizer/v/dense/bias", H5P_DEFAULT);
    REQUIRE(ds >= 0);
    REQUIRE(H5Adelete(ds, "crc32") >= 0);
    const hsize_t two = 2;
    hid_t space = H5Screate_simple(1, &two, nullptr);
    hid_t attr = H5Acreate2(ds, "crc32", H5T_STD_U64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    const std::uint64_t values[2] = {1, 2};
    REQUIRE(H5Awrite(attr, H5T_NATIVE_UINT64, values) >= 0);
    H5Aclose(attr);
    H5Sclose(space);
    H5Dclose(ds);
    H5Fclose(file);
  }
  nn::Sequential model(model_config(), 2, testing::cpu());
  auto optimizer = make_optimizer();
  const std::string message = error_of([&] { ckpt::restore(path, model, *optimizer); });
  CHECK_MESSAGE(message.find("the crc32 attribute of /optimizer/v/dense/bias is not a single integer") != std::string::npos,
                message);
  CHECK(message.find(path) != std::string::npos);
}

TEST_CASE("checkpoint: a file without the seal's magic or HDF5's signature at byte 0 is not trusted") {
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  write_sample(path);
  // One flipped bit in the magic, and an optimizer slot damaged: eval reads no slot, so only the
  // whole-file check can see it, and it must not be switched off by the flip.
  flip_byte(path, data_offset(path, "/optimizer/v/dense/bias"));
  for (int bit = 0; bit < 8; ++bit) {
    CAPTURE(bit);
    const std::string flipped = dir.file("flipped.h5");
    fs::copy_file(path, flipped, fs::copy_options::overwrite_existing);
    std::fstream f(flipped, std::ios::in | std::ios::out | std::ios::binary);
    char c = 0;
    f.seekg(bit % 8);
    f.read(&c, 1);
    c = static_cast<char>(c ^ (1 << bit));
    f.seekp(bit % 8);
    f.write(&c, 1);
    f.close();
    CHECK(ckpt::verify_seal(flipped) == std::optional<bool>(false));
    nn::Sequential model(model_config(), 2, testing::cpu());
    CHECK(error_of([&] { ckpt::restore_model(flipped, model); }).find("no dtrain seal") != std::string::npos);
  }
}

TEST_CASE("checkpoint: a FIFO is refused, not opened") {
  TempDir dir;
  const std::string fifo = dir.file("ckpt-5.h5");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(error_of([&] { ckpt::peek(fifo); }).find("not a regular file") != std::string::npos);
}

TEST_CASE("checkpoint: h5dump shows readable names") {
  if (!fs::exists("/usr/bin/h5dump")) return;
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  write_sample(path);
  FILE* pipe = ::popen(fmt::format("/usr/bin/h5dump -n '{}' 2>&1", path).c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string listing;
  char buffer[4096];
  while (std::size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) listing.append(buffer, n);
  CHECK(::pclose(pipe) == 0);
  CAPTURE(listing);
  for (const char* name : {"/model/conv2d/kernel", "/model/conv2d/bias", "/model/dense/kernel", "/optimizer/m/dense/bias",
                           "/optimizer/v/conv2d/kernel", "/state/epoch", "/state/metrics/0/counts", "/experiment"}) {
    CHECK(listing.find(name) != std::string::npos);
  }
}

TEST_CASE("checkpoint: position_in_training counts epochs from 1, as the epoch lines do") {
  ckpt::TrainingState s;
  s.epoch = 0;
  s.step_in_epoch = 10;
  CHECK(ckpt::position_in_training(s) == "epoch 1, step 10 of it");
  s.epoch = 1;
  s.step_in_epoch = 0;  // epoch 1 done, epoch 2 not begun
  CHECK(ckpt::position_in_training(s) == "after epoch 1");
}
