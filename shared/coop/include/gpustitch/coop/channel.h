// The cooperative-release channel: Unix datagram sockets in the abstract namespace, with the
// kernel vouching for every sender.
//
// Naming. A preloaded process with coop on listens on "\0<prefix>-coop.<pid>.<start_time>", the
// pid and start time of its statistics record (names.h). A requester finds its peers from their
// records and sends to that name; because the name carries the start time, a request can never
// reach a process that merely reused a dead peer's pid. Requesters send from an autobound socket
// (a kernel-chosen abstract name), where the replies come back.
//
// Trust. Abstract names have no file permissions: anyone on the node can send to a listener. So
// the listener sets SO_PASSCRED and the kernel attaches the sender's real pid/uid/gid to every
// datagram (a sender cannot forge them; only root may claim other ids). The listener accepts
// requests only from its own uid or root (gpustitchd forwarding across users), and rate-limits
// what it accepts with a token bucket. A request can only ask for idle cache to be released.
//
// Everything here is noexcept and returns failures as values: it runs inside other people's
// processes.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "gpustitch/coop/wire.h"

namespace gpustitch::coop {

inline constexpr std::string_view kDefaultPrefix = "gpustitch";

// The abstract name (without the leading NUL) a process listens on.
std::string listener_name(pid_t pid, std::uint64_t start_time,
                          std::string_view prefix = kDefaultPrefix);

struct Peer {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  bool has_credentials = false;  // false: the kernel attached none (never for SO_PASSCRED)
};

struct Received {
  std::optional<Message> message;  // nullopt: malformed datagram
  std::size_t length = 0;          // bytes received (a longer datagram is cut: malformed)
  Peer sender;
  sockaddr_un from{};
  socklen_t from_len = 0;
};

class Socket {
 public:
  // A listener bound to listener_name(pid, start_time, prefix), with SO_PASSCRED.
  static std::optional<Socket> listen(pid_t pid, std::uint64_t start_time,
                                      std::string_view prefix = kDefaultPrefix) noexcept;
  // An autobound socket (kernel-chosen abstract name) for sending requests and getting replies.
  static std::optional<Socket> ephemeral() noexcept;

  Socket(Socket&& other) noexcept;
  Socket& operator=(Socket&& other) noexcept;
  ~Socket();
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const noexcept { return fd_; }

  // Sends m to the listener of (pid, start_time). False when no such listener (or send failed).
  bool send_to(pid_t pid, std::uint64_t start_time, const Message& m,
               std::string_view prefix = kDefaultPrefix) const noexcept;
  // Sends m to an address a datagram came from.
  bool send_to(const sockaddr_un& to, socklen_t len, const Message& m) const noexcept;
  // Sends raw bytes to a listener (tests of hostile input).
  bool send_raw(pid_t pid, std::uint64_t start_time, const void* data, std::size_t size,
                std::string_view prefix = kDefaultPrefix) const noexcept;

  // Waits up to timeout_ms (-1: forever) for one datagram. nullopt on timeout or error.
  std::optional<Received> receive(int timeout_ms) const noexcept;

 private:
  explicit Socket(int fd) noexcept : fd_(fd) {}
  int fd_ = -1;
};

// Token bucket: `rate` tokens per second, at most `burst` saved up. take() spends one if any.
class TokenBucket {
 public:
  TokenBucket(double rate, double burst) noexcept : rate_(rate), burst_(burst), tokens_(burst) {}
  bool take(std::uint64_t now_ns) noexcept;

 private:
  double rate_, burst_, tokens_;
  std::uint64_t last_ns_ = 0;
};

// CLOCK_MONOTONIC in nanoseconds.
std::uint64_t monotonic_ns() noexcept;

}  // namespace gpustitch::coop
