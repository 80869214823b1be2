// libFuzzer target: arbitrary bytes as a cooperative-release datagram. decode() must reject or
// accept them without crashing or reading out of bounds, and what it accepts must re-encode to
// the same bytes (except the ignored reserved tail).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gpustitch/coop/wire.h"

using namespace gpustitch::coop;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto m = decode(std::span<const std::uint8_t>(data, size));
  if (!m) return 0;
  if (m->bytes > kMaxBytes || m->origin_pid < 0) std::abort();
  std::uint8_t again[kMessageBytes];
  encode(*m, again);
  if (std::memcmp(again, data, 48) != 0) std::abort();
  return 0;
}
