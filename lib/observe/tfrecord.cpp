#include "observe/tfrecord.hpp"

#include <array>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::observe {
namespace {

// The table of the reflected Castagnoli polynomial 0x1EDC6F41 (reversed: 0x82F63B78): entry b is
// the CRC of the single byte b, so the CRC advances a byte per lookup.
constexpr std::array<std::uint32_t, 256> make_crc32c_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t crc = b;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    table[b] = crc;
  }
  return table;
}

constexpr std::array<std::uint32_t, 256> kCrc32cTable = make_crc32c_table();

void put_le(unsigned char* out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<unsigned char>(value >> (8 * i));
}

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t crc = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < size; ++i) crc = kCrc32cTable[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

std::uint32_t masked_crc32c(const void* data, std::size_t size) {
  const std::uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

TFRecordWriter::TFRecordWriter(std::string path) : path_(std::move(path)) {
  file_ = std::fopen(path_.c_str(), "wbx");  // "x": fail rather than write into an existing file
  if (!file_)
    throw IoError(fmt::format("cannot create {}: {}; check that the run directory is writable", path_,
                              std::strerror(errno)));
}

TFRecordWriter::~TFRecordWriter() {
  if (file_) std::fclose(file_);
}

void TFRecordWriter::write(std::string_view record) {
  unsigned char header[12];
  put_le(header, record.size(), 8);
  put_le(header + 8, masked_crc32c(header, 8), 4);
  unsigned char footer[4];
  put_le(footer, masked_crc32c(record.data(), record.size()), 4);
  if (std::fwrite(header, 1, sizeof header, file_) != sizeof header ||
      std::fwrite(record.data(), 1, record.size(), file_) != record.size() ||
      std::fwrite(footer, 1, sizeof footer, file_) != sizeof footer)
    throw IoError(fmt::format("cannot append to {}: {}", path_, std::strerror(errno)));
}

void TFRecordWriter::flush() {
  if (std::fflush(file_) != 0) throw IoError(fmt::format("cannot write {}: {}", path_, std::strerror(errno)));
}

}  // namespace dtrain::observe
