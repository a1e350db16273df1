#pragma once
// The central directory of a zip archive (what torch.save writes), read independently of miniz so that
// amp can check each record it reads: caffe2's PyTorchStreamReader returns a record's declared size even
// where miniz extracted nothing (an entry flagged as a directory, or with a compressed size of 0), which
// leaves the caller with uninitialized memory and no error.

#include <cstdint>
#include <map>
#include <string>

namespace amp::detail {

struct ZipRecord {
  uint16_t method = 0;          // 0 stored (torch.save's choice), 8 deflate
  uint32_t crc32 = 0;           // 0 where the writer did not compute it (torch's compute_crc32=False)
  uint64_t compressed_size = 0;
  uint64_t uncompressed_size = 0;
  uint32_t external_attributes = 0;
  bool is_directory = false;    // as miniz decides it: a trailing '/' or the DOS directory attribute
};

/// Reads the central directory of the zip file at `path`; names are as stored (torch's archive prefix
/// included, e.g. "checkpoint/data/0"). Throws std::runtime_error on a file that has no readable directory.
std::map<std::string, ZipRecord> read_zip_directory(const std::string& path);

/// The CRC-32 (ISO-HDLC, as zip uses) of `size` bytes.
uint32_t crc32(const void* data, size_t size);

}  // namespace amp::detail
