// TFRecord files, the container of TensorBoard's event files: each record is
//   uint64 length (little-endian), uint32 masked CRC32C of those 8 bytes,
//   the data, uint32 masked CRC32C of the data.
// The CRC is CRC-32C (Castagnoli, the polynomial iSCSI and ext4 use), "masked" by a rotation and
// an added constant so that a CRC computed over bytes that themselves contain CRCs stays strong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace dtrain::observe {

// CRC-32C of `size` bytes (table-driven, one byte at a time); crc32c("123456789") = 0xE3069283.
std::uint32_t crc32c(const void* data, std::size_t size);
// TFRecord's mask: rotate right by 15 bits, add 0xa282ead8.
std::uint32_t masked_crc32c(const void* data, std::size_t size);

// Appends records to a new file. Records reach the file when flush() is called (or the writer is
// destroyed); a process killed in between loses the unflushed ones, and at most a truncated last
// record, which TFRecord readers skip.
class TFRecordWriter {
 public:
  // Creates `path`, which must not exist yet (a writer never appends to another's file).
  explicit TFRecordWriter(std::string path);
  ~TFRecordWriter();
  TFRecordWriter(const TFRecordWriter&) = delete;
  TFRecordWriter& operator=(const TFRecordWriter&) = delete;

  void write(std::string_view record);
  void flush();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace dtrain::observe
