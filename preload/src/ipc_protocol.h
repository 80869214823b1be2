// CUDA IPC on pool memory: the 64-byte handle and the messages between the exporting and the
// importing process. See ipc_export.cpp for the design.
//
// The handle (cudaIpcMemHandle_t / CUipcMemHandle, 64 opaque bytes) names an export of one process:
//   magic "GPUSTIPC" | version | exporter pid | exporter uid | 0 | export id | 16-byte token | 0...
// The token (getrandom) is the capability: knowing the pid and id is not enough to map the memory.
// A handle without the magic is the driver's own and goes to the driver.
//
// The exchange, on the exporter's Unix socket in the abstract namespace
// ("\0gpustitch-ipc-<pid>-<uid>"): the importer sends one Request; the exporter checks the peer's
// credentials (SO_PEERCRED: peer_allowed) and the token, and answers one Reply, then the pieces'
// sizes in batches of at most kPiecesPerMessage, each batch carrying as many file descriptors
// (SCM_RIGHTS), one per physical handle. The connection then stays open: it is the importer's
// lease on the memory, which the exporter keeps out of reuse until the connection closes (the
// importer closed the handle, or its process ended).
#pragma once

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace gpustitch::preload::ipc {

inline constexpr std::uint64_t kMagic = 0x4350495453555047ull;  // "GPUSTIPC" in memory order
inline constexpr std::uint32_t kVersion = 1;
inline constexpr std::size_t kHandleSize = 64;
inline constexpr std::size_t kTokenSize = 16;
inline constexpr std::size_t kPiecesPerMessage = 128;  // below the kernel's SCM_MAX_FD (253)

struct Handle {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t pid;
  std::uint32_t uid;
  std::uint32_t reserved;
  std::uint64_t export_id;
  std::uint8_t token[kTokenSize];
  std::uint8_t zero[16];
};
static_assert(sizeof(Handle) == kHandleSize);

inline bool is_ours(const void* bytes) noexcept {
  std::uint64_t magic = 0;
  std::memcpy(&magic, bytes, sizeof magic);
  return magic == kMagic;
}

struct Request {
  std::uint64_t magic;
  std::uint64_t export_id;
  std::uint8_t token[kTokenSize];
};

// Reply status: what the importer's open returns for each (invalid_value: CUDA's answer for a
// handle it does not know).
enum class ReplyStatus : std::uint32_t { ok = 0, refused = 1, unknown = 2, failed = 3 };

struct Reply {
  std::uint64_t magic;
  ReplyStatus status;
  std::uint32_t pieces;   // handles of the block, in address order
  std::uint64_t size;     // their sizes summed: the range the importer reserves
  std::uint64_t offset;   // where in that range the block starts
  std::uint8_t uuid[16];  // the exporter's device (CUDA ordinals differ between processes)
  std::uint32_t has_uuid;
  std::uint32_t reserved;
};

struct PieceBatch {
  std::uint32_t count;
  std::uint32_t reserved;
  std::uint64_t sizes[kPiecesPerMessage];
};

// The abstract socket name of the exporter pid running as uid (without the leading NUL).
inline int socket_name(char* out, std::size_t n, std::uint32_t pid, std::uint32_t uid) noexcept {
  return std::snprintf(out, n, "gpustitch-ipc-%u-%u", pid, uid);
}

// Who may import: a process of the same user, or root. (Abstract sockets have no file
// permissions, so this check is what keeps other users out.)
inline bool peer_allowed(uid_t self, uid_t peer) noexcept {
  return peer == self || peer == 0;
}

// Bounds every later send and receive on fd to seconds each, so that a peer that stops
// answering makes the call fail instead of hanging this process.
inline void set_socket_timeouts(int fd, int seconds) noexcept {
  timeval tv{seconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// Reads exactly n bytes from the stream socket fd into out. False on end of stream, an error, or
// a receive timeout (set_socket_timeouts) with nothing read. A short read (a timeout or signal
// after part of the bytes) continues with the rest, each receive bounded by the timeout again.
inline bool recv_exact(int fd, void* out, std::size_t n) noexcept {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    ssize_t got = recv(fd, p, n, MSG_WAITALL);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

}  // namespace gpustitch::preload::ipc
