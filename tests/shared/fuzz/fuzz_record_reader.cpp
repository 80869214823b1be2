// libFuzzer target: arbitrary bytes as a statistics record. The reader must reject or decode
// them without crashing, hanging or reading out of bounds, through the pure decoders and through
// a real file opened with RecordReader (as gpustitchd reads /dev/shm).
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "gpustitch/shm/record_reader.h"

using namespace gpustitch::shm;

namespace {
std::string scratch_path() {
  static std::string path = [] {
    char tmpl[] = "/tmp/fuzz-record-XXXXXX";
    int fd = ::mkstemp(tmpl);
    if (fd >= 0) ::close(fd);
    return std::string(tmpl);
  }();
  return path;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::uint8_t> bytes(data, size);
  ProcessIdentity id;
  RecordName name{"fuzz", ::geteuid(), 1, 1};
  (void)validate_prefix(bytes, nullptr, &id);
  (void)validate_prefix(bytes, &name, &id);
  SnapshotCopy snap;
  (void)decode_snapshot(bytes, &snap);
  (void)decode_events(bytes);
  (void)decode_sites(bytes);
  if (size >= offsetof(Record, snapshot)) {
    (void)decode_snapshot(bytes.subspan(offsetof(Record, snapshot)), &snap);
  }
  // Through a file: pad or cut to the record size so that open() reaches the header checks.
  std::string path = scratch_path();
  int fd = ::open(path.c_str(), O_WRONLY | O_TRUNC);
  if (fd < 0) return 0;
  (void)!::write(fd, data, size);
  if (size < sizeof(Record) && size > 0 && data[0] & 1) (void)!::ftruncate(fd, sizeof(Record));
  ::close(fd);
  ReadError err;
  auto reader = RecordReader::open_path(path, nullptr, std::nullopt, &err);
  if (reader) {
    (void)reader->read_snapshot(&snap);
    std::vector<EventCopy> events;
    (void)reader->read_events(&events);
    std::vector<SiteCopy> sites;
    (void)reader->read_sites(&sites);
  }
  return 0;
}
