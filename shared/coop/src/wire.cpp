// Encoding of the cooperative-release datagram. See wire.h. Fields are packed at fixed offsets
// in the host's (little-endian) byte order; the layout is pinned here:
//   0 magic u32 | 4 version u16 | 6 kind u16 | 8 id u64 | 16 uuid[16] | 32 bytes u64 |
//   40 origin_pid i32 | 44 status u32 | 48 reserved (16 bytes, written as zero, ignored)
#include "gpustitch/coop/wire.h"

#include <cstring>

namespace gpustitch::coop {
namespace {

template <typename T>
void put(std::uint8_t* p, std::size_t off, T v) noexcept {
  std::memcpy(p + off, &v, sizeof v);
}
template <typename T>
T get(const std::uint8_t* p, std::size_t off) noexcept {
  T v;
  std::memcpy(&v, p + off, sizeof v);
  return v;
}

}  // namespace

void encode(const Message& m, std::span<std::uint8_t, kMessageBytes> out) noexcept {
  std::uint8_t* p = out.data();
  std::memset(p, 0, kMessageBytes);
  put(p, 0, kMagic);
  put(p, 4, kVersion);
  put(p, 6, static_cast<std::uint16_t>(m.kind));
  put(p, 8, m.id);
  std::memcpy(p + 16, m.uuid, kUuidBytes);
  put(p, 32, m.bytes);
  put(p, 40, m.origin_pid);
  put(p, 44, static_cast<std::uint32_t>(m.status));
}

std::optional<Message> decode(std::span<const std::uint8_t> bytes) noexcept {
  if (bytes.size() != kMessageBytes) return std::nullopt;
  const std::uint8_t* p = bytes.data();
  if (get<std::uint32_t>(p, 0) != kMagic || get<std::uint16_t>(p, 4) != kVersion) {
    return std::nullopt;
  }
  Message m;
  const auto kind = get<std::uint16_t>(p, 6);
  if (kind != static_cast<std::uint16_t>(Kind::request) &&
      kind != static_cast<std::uint16_t>(Kind::reply)) {
    return std::nullopt;
  }
  m.kind = static_cast<Kind>(kind);
  m.id = get<std::uint64_t>(p, 8);
  std::memcpy(m.uuid, p + 16, kUuidBytes);
  m.bytes = get<std::uint64_t>(p, 32);
  if (m.bytes > kMaxBytes) return std::nullopt;
  m.origin_pid = get<std::int32_t>(p, 40);
  if (m.origin_pid < 0) return std::nullopt;
  const auto status = get<std::uint32_t>(p, 44);
  if (status > static_cast<std::uint32_t>(ReplyStatus::refused)) return std::nullopt;
  if (m.kind == Kind::request && status != 0) return std::nullopt;
  m.status = static_cast<ReplyStatus>(status);
  return m;
}

}  // namespace gpustitch::coop
