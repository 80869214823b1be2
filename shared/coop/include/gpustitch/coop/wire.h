// The cooperative-release wire format: one fixed 64-byte datagram, the same for requests and
// replies, exchanged over Unix datagram sockets between preloaded processes (and gpustitchd) on
// one node. See channel.h for the sockets and docs/coop.md for the protocol.
//
// A request says "release idle cached memory of the GPU with this UUID, about this many bytes";
// the reply says how many bytes were released. Nothing in a message names an address, a block or
// any data: the worst a request can cause is the release of idle cache, which the receiver
// rate-limits. decode() treats every byte as hostile: exact size, magic, version, kind, status and
// a sane byte count, or nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

namespace gpustitch::coop {

inline constexpr std::uint32_t kMagic = 0x50435347u;  // "GSCP", little endian
inline constexpr std::uint16_t kVersion = 1;
inline constexpr std::size_t kUuidBytes = 16;
inline constexpr std::size_t kMessageBytes = 64;
// No GPU has a petabyte: a larger request is malformed, not ambitious.
inline constexpr std::uint64_t kMaxBytes = std::uint64_t{1} << 50;

enum class Kind : std::uint16_t { request = 1, reply = 2 };

enum class ReplyStatus : std::uint32_t {
  ok = 0,            // bytes = released (may be 0: nothing idle)
  rate_limited = 1,  // too many requests lately; nothing released
  no_device = 2,     // this process has no pool on that GPU
  refused = 3,       // coop:off, or the sender may not ask
};

struct Message {
  Kind kind = Kind::request;
  std::uint64_t id = 0;  // chosen by the requester, echoed in the reply
  std::uint8_t uuid[kUuidBytes] = {};
  std::uint64_t bytes = 0;      // request: wanted; reply: released
  std::int32_t origin_pid = 0;  // the process that needs the memory (set by gpustitchd when it
                                // forwards a request; otherwise the sender itself)
  ReplyStatus status = ReplyStatus::ok;  // replies only
};

// Exactly kMessageBytes into out.
void encode(const Message& m, std::span<std::uint8_t, kMessageBytes> out) noexcept;
// nullopt unless bytes is one well-formed message.
std::optional<Message> decode(std::span<const std::uint8_t> bytes) noexcept;

}  // namespace gpustitch::coop
