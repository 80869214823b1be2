// Sockets of the cooperative-release channel. See channel.h for naming and trust.
#include "gpustitch/coop/channel.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

namespace gpustitch::coop {
namespace {

// Fills an abstract address for name; returns its length, or 0 when the name does not fit.
socklen_t abstract_address(std::string_view name, sockaddr_un* addr) noexcept {
  std::memset(addr, 0, sizeof *addr);
  addr->sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof addr->sun_path) return 0;
  std::memcpy(addr->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

int make_socket() noexcept {
  int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  int on = 1;
  if (::setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

std::string listener_name(pid_t pid, std::uint64_t start_time, std::string_view prefix) {
  return std::string(prefix) + "-coop." + std::to_string(pid) + "." + std::to_string(start_time);
}

std::optional<Socket> Socket::listen(pid_t pid, std::uint64_t start_time,
                                     std::string_view prefix) noexcept {
  try {
    sockaddr_un addr;
    socklen_t len = abstract_address(listener_name(pid, start_time, prefix), &addr);
    if (len == 0) return std::nullopt;
    int fd = make_socket();
    if (fd < 0) return std::nullopt;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      ::close(fd);
      return std::nullopt;
    }
    return Socket(fd);
  } catch (...) {
    return std::nullopt;
  }
}

std::optional<Socket> Socket::ephemeral() noexcept {
  int fd = make_socket();
  if (fd < 0) return std::nullopt;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // Binding with only the family autobinds to a unique abstract name.
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(sa_family_t)) != 0) {
    ::close(fd);
    return std::nullopt;
  }
  return Socket(fd);
}

Socket::Socket(Socket&& other) noexcept : fd_(other.fd_) {
  other.fd_ = -1;
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

bool Socket::send_raw(pid_t pid, std::uint64_t start_time, const void* data, std::size_t size,
                      std::string_view prefix) const noexcept {
  try {
    sockaddr_un addr;
    socklen_t len = abstract_address(listener_name(pid, start_time, prefix), &addr);
    if (len == 0) return false;
    return ::sendto(fd_, data, size, MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&addr), len) ==
           static_cast<ssize_t>(size);
  } catch (...) {
    return false;
  }
}

bool Socket::send_to(pid_t pid, std::uint64_t start_time, const Message& m,
                     std::string_view prefix) const noexcept {
  std::uint8_t buf[kMessageBytes];
  encode(m, buf);
  return send_raw(pid, start_time, buf, sizeof buf, prefix);
}

bool Socket::send_to(const sockaddr_un& to, socklen_t len, const Message& m) const noexcept {
  if (len <= offsetof(sockaddr_un, sun_path)) return false;  // unnamed sender: nowhere to reply
  std::uint8_t buf[kMessageBytes];
  encode(m, buf);
  return ::sendto(fd_, buf, sizeof buf, MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&to),
                  len) == static_cast<ssize_t>(sizeof buf);
}

std::optional<Received> Socket::receive(int timeout_ms) const noexcept {
  pollfd p{fd_, POLLIN, 0};
  for (;;) {
    int r = ::poll(&p, 1, timeout_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return std::nullopt;
    break;
  }
  Received out;
  std::uint8_t buf[kMessageBytes + 1];  // one more: a longer datagram shows as truncated
  iovec iov{buf, sizeof buf};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred))];
  msghdr msg{};
  msg.msg_name = &out.from;
  msg.msg_namelen = sizeof out.from;
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n = ::recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
  if (n < 0) return std::nullopt;
  out.from_len = msg.msg_namelen;
  out.length = static_cast<std::size_t>(n);
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS &&
        c->cmsg_len >= CMSG_LEN(sizeof(ucred))) {
      ucred cred;
      std::memcpy(&cred, CMSG_DATA(c), sizeof cred);
      out.sender = Peer{cred.pid, cred.uid, cred.gid, true};
    } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      // Nobody should send us descriptors; close any that arrive so they cannot pile up.
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        ::close(fd);
      }
    }
  }
  if ((msg.msg_flags & MSG_TRUNC) == 0 && out.length == kMessageBytes) {
    out.message = decode(std::span<const std::uint8_t>(buf, out.length));
  }
  return out;
}

bool TokenBucket::take(std::uint64_t now_ns) noexcept {
  if (last_ns_ != 0 && now_ns > last_ns_) {
    tokens_ = std::min(burst_, tokens_ + rate_ * static_cast<double>(now_ns - last_ns_) / 1e9);
  }
  last_ns_ = now_ns;
  if (tokens_ < 1.0) return false;
  tokens_ -= 1.0;
  return true;
}

std::uint64_t monotonic_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

}  // namespace gpustitch::coop
