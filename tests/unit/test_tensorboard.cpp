// TensorBoard's event files: CRC-32C against its published check values, TFRecord framing read
// back byte by byte, and the events parsed with the same generated protobuf classes TensorBoard's
// schema gives. (tests/integration/tensorboard.sh reads a real run's files with Python's protobuf.)
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <tensorflow/core/util/event.pb.h>

#include "config/parse.hpp"
#include "core/error.hpp"
#include "observe/tensorboard.hpp"
#include "observe/tfrecord.hpp"
#include "test_support.hpp"

using namespace dtrain;
using namespace dtrain::observe;
namespace fs = std::filesystem;

namespace {

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::uint64_t le(const std::string& bytes, std::size_t at, int count) {
  std::uint64_t v = 0;
  for (int i = count - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[at + static_cast<std::size_t>(i)]);
  return v;
}

// The records of a TFRecord file, each CRC checked.
std::vector<std::string> read_records(const fs::path& path) {
  const std::string bytes = read_all(path);
  std::vector<std::string> records;
  std::size_t at = 0;
  while (at < bytes.size()) {
    REQUIRE(at + 12 <= bytes.size());
    const std::uint64_t length = le(bytes, at, 8);
    CHECK(le(bytes, at + 8, 4) == masked_crc32c(bytes.data() + at, 8));
    REQUIRE(at + 12 + length + 4 <= bytes.size());
    const std::string data = bytes.substr(at + 12, length);
    CHECK(le(bytes, at + 12 + length, 4) == masked_crc32c(data.data(), data.size()));
    records.push_back(data);
    at += 12 + length + 4;
  }
  return records;
}

}  // namespace

TEST_CASE("tensorboard: CRC-32C gives the standard check values, and the TFRecord mask") {
  CHECK(crc32c("123456789", 9) == 0xE3069283u);
  CHECK(crc32c("", 0) == 0u);
  // RFC 3720 (iSCSI), B.4: 32 bytes of zeros, of ones.
  const std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xFF);
  CHECK(crc32c(zeros.data(), zeros.size()) == 0x8A9136AAu);
  CHECK(crc32c(ones.data(), ones.size()) == 0x62A8AB43u);
  // Rotated right by 15 bits, plus 0xa282ead8.
  CHECK(masked_crc32c("123456789", 9) == 0xC78AB0E5u);
}

TEST_CASE("tensorboard: TFRecord framing, and a writer never opens an existing file") {
  testing::ScratchDir dir("tensorboard");
  const fs::path path = dir.path() / "records";
  {
    TFRecordWriter writer(path.string());
    writer.write("abc");
    writer.write("");
    writer.write(std::string(300, 'x'));
  }
  const std::string bytes = read_all(path);
  CHECK(bytes.size() == (12 + 3 + 4) + (12 + 0 + 4) + (12 + 300 + 4));
  CHECK(le(bytes, 0, 8) == 3);
  CHECK(bytes.substr(12, 3) == "abc");
  const std::vector<std::string> records = read_records(path);
  REQUIRE(records.size() == 3);
  CHECK(records[0] == "abc");
  CHECK(records[1].empty());
  CHECK(records[2] == std::string(300, 'x'));
  CHECK_THROWS_AS(TFRecordWriter(path.string()), IoError);
  CHECK(read_all(path) == bytes);
}

TEST_CASE("tensorboard: an event file starts with the file version, then the scalars at their steps") {
  testing::ScratchDir dir("tensorboard");
  const fs::path logdir = dir.path() / "tensorboard";
  std::string first, second;
  {
    EventFileWriter writer(logdir.string());
    writer.scalars(7, {{"train/loss", 0.25}, {"test/accuracy", 0.875}});
    first = writer.path();
    // A second writer in the same second gets a file of its own.
    EventFileWriter again(logdir.string());
    again.session_start(8);
    second = again.path();
  }
  CHECK(first != second);
  CHECK(fs::path(second).filename() > fs::path(first).filename());  // read after it
  CHECK(fs::path(first).filename().string().starts_with("events.out.tfevents."));
  const std::vector<std::string> records = read_records(first);
  REQUIRE(records.size() == 2);
  tensorflow::Event version, scalars;
  REQUIRE(version.ParseFromString(records[0]));
  CHECK(version.file_version() == "brain.Event:2");
  CHECK(version.wall_time() > 1.5e9);
  REQUIRE(scalars.ParseFromString(records[1]));
  CHECK(scalars.step() == 7);
  REQUIRE(scalars.summary().value_size() == 2);
  CHECK(scalars.summary().value(0).tag() == "train/loss");
  CHECK(scalars.summary().value(0).simple_value() == 0.25f);
  CHECK(scalars.summary().value(1).tag() == "test/accuracy");
  CHECK(scalars.summary().value(1).simple_value() == 0.875f);
  const std::vector<std::string> resumed = read_records(second);
  REQUIRE(resumed.size() == 2);
  tensorflow::Event start;
  REQUIRE(start.ParseFromString(resumed[1]));
  CHECK(start.step() == 8);
  CHECK(start.session_log().status() == tensorflow::SessionLog::START);
}

TEST_CASE("tensorboard: a new event file's name sorts after every event file already in the directory") {
  // TensorBoard reads a directory's files in name order; a resume within the same second, by a pid
  // that sorts lower, or on a host whose clock is behind, must still be read after the first run.
  testing::ScratchDir dir("tensorboard_order");
  const fs::path logdir = dir.path() / "tensorboard";
  fs::create_directories(logdir);
  const auto now = static_cast<long long>(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  const std::string ahead = fmt::format("events.out.tfevents.{:010d}.zzzz.999999999", now + 100);
  std::ofstream(logdir / ahead) << "";
  // Another tool's file with no seconds in its name sorts where it does and is left alone.
  std::ofstream(logdir / "events.out.tfevents.notes") << "";
  const std::string made = fs::path(EventFileWriter(logdir.string()).path()).filename().string();
  CHECK(made > ahead);
  CHECK(made.starts_with(fmt::format("events.out.tfevents.{:010d}.", now + 101)));
  // With no file ahead of the clock the name carries the clock's seconds.
  testing::ScratchDir fresh("tensorboard_fresh");
  const std::string plain = fs::path(EventFileWriter((fresh.path() / "tb").string()).path()).filename().string();
  const long long named = std::stoll(plain.substr(std::string("events.out.tfevents.").size(), 10));
  CHECK(named >= now);
  CHECK(named <= now + 60);
}

TEST_CASE("tensorboard: train.tensorboard and train.log_every_steps are read, written back and checked") {
  const std::string minimal = "model:\n  input_shape: [4]\n  layers:\n    - dense: {units: 2}\n";
  const config::Experiment defaults = config::parse_experiment(minimal, "t.yaml", {});
  CHECK_FALSE(defaults.train.tensorboard);
  CHECK(defaults.train.log_every_steps == 100);
  const config::Experiment e =
      config::parse_experiment(minimal + "train: {tensorboard: true, log_every_steps: 0}\n", "t.yaml", {});
  CHECK(e.train.tensorboard);
  CHECK(e.train.log_every_steps == 0);
  CHECK(config::parse_experiment(config::to_yaml(e), "resolved.yaml", {}).train == e.train);
  CHECK_THROWS_AS(config::parse_experiment(minimal, "t.yaml", {"train.log_every_steps=-1"}), ConfigError);
  CHECK_THROWS_AS(config::parse_experiment(minimal, "t.yaml", {"train.tensorboard=maybe"}), ConfigError);
}
