// CUDA IPC on pool memory, the exporting side: cudaIpcGetMemHandle/cuIpcGetMemHandle on a pool
// block, and the server that hands the block's physical memory to importing processes.
//
// Why not the driver's IPC. cudaIpcGetMemHandle works only on cudaMalloc memory; pool blocks are
// virtual-memory mappings (cuMemCreate + cuMemMap), which CUDA shares as file descriptors of their
// physical handles (cuMemExportToShareableHandle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: the
// backend asks for that type at cuMemCreate). A descriptor has to reach the other process through
// the kernel; PyTorch's expandable segments take it with pidfd_getfd, which needs ptrace rights
// over the exporter and fails in most containers. Here the exporter passes it over a Unix socket
// (SCM_RIGHTS), which needs no such right, and checks who asks.
//
// The handle (ipc_protocol.h) carries a magic, the exporter's pid and uid, an export id and a
// random token. One export per live block: a second cudaIpcGetMemHandle on the block returns the
// same handle, as CUDA's does. The export pins the block (Pool::pin), so that its address cannot be
// freed and reused for another allocation while the export stands; when the program frees the
// block, the pinned-free handler withdraws the export (later opens fail, as they do for freed
// cudaMalloc memory) and drops that pin. Each importer's open pins the block once more, for as
// long as its connection (its lease) stays open, so memory an importer still maps is never reused
// by this process; the last close, or the importer's death, lets the deferred free happen.
//
// The server: a Unix stream socket in the abstract namespace, "\0gpustitch-ipc-<pid>-<uid>"
// (abstract: no file to create or clean up, gone with the process; per network namespace, so
// processes sharing a GPU in one container or host see it), served by one thread started at the
// first export. It poll()s the listening socket and the open leases; a request is read with a
// 2-second timeout, so a stalled client delays other importers at most that long and never the
// program: the program's threads take the server's mutex only to export a block or, at free, to
// withdraw an export, and the server thread never holds it across a socket call. The thread
// blocks every signal (the program's handlers run on the program's threads), holds nothing that
// keeps the process alive (exit() ends it), and does not exist in a fork()ed child: the child
// forgets the parent's exports and closes its copies of the sockets.
//
// Credentials: SO_PEERCRED of the connecting socket, checked by peer_allowed (same uid, or
// root); an abstract socket has no file permissions, so this is the access check. The token keeps
// a process of the same user from mapping blocks it was not given a handle for.
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ipc.h"
#include "ipc_protocol.h"
#include "shim.h"

namespace gpustitch::preload::ipc {
namespace {

struct Export {
  std::uint64_t id = 0;
  std::uint8_t token[kTokenSize] = {};
  DevPtr base = 0;
  PhysicalLayout layout;
  DeviceUuid uuid{};
  bool has_uuid = false;
};

struct Lease {
  int fd = -1;
  DevPtr base = 0;
};

struct Server {
  std::mutex mu;  // exports, leases and the start; never held across a socket call
  Pool* pool = nullptr;
  std::unordered_map<DevPtr, std::unique_ptr<Export>> by_base;
  std::unordered_map<std::uint64_t, Export*> by_id;
  std::uint64_t next_id = 1;
  int listen_fd = -1;
  bool started = false;
  // Open leases: changed by the server thread only, under mu (so that a fork sees them whole).
  std::vector<Lease> leases;
};

Server& server() {
  static Server* s = new Server();  // never destroyed: the thread may run until exit
  return *s;
}

bool fill_random(std::uint8_t* out, std::size_t n) noexcept {
  while (n > 0) {
    ssize_t got = getrandom(out, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    out += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

bool same_token(const std::uint8_t* a, const std::uint8_t* b) noexcept {
  unsigned diff = 0;  // constant time: no early exit on the first differing byte
  for (std::size_t i = 0; i < kTokenSize; ++i) diff |= static_cast<unsigned>(a[i] ^ b[i]);
  return diff == 0;
}

bool send_all(int fd, const void* data, std::size_t n, const int* fds, std::size_t nfds) noexcept {
  iovec iov{const_cast<void*>(data), n};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kPiecesPerMessage)];
  if (nfds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  // A stream socket: the first sendmsg carries the descriptors with the first byte; the rest of
  // the bytes follow without them.
  for (;;) {
    ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    iov.iov_base = static_cast<char*>(iov.iov_base) + sent;
    iov.iov_len -= static_cast<std::size_t>(sent);
    if (iov.iov_len == 0) return true;
    msg.msg_control = nullptr;
    msg.msg_controllen = 0;
  }
}

void reply_status(int fd, ReplyStatus status) noexcept {
  Reply r{};
  r.magic = kMagic;
  r.status = status;
  send_all(fd, &r, sizeof r, nullptr, 0);
}

// One importer's request: checks, pins, sends the descriptors. Returns whether fd became a lease.
bool serve_request(Server& s, int fd) noexcept {
  set_socket_timeouts(fd, 2);
  ucred cred{};
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
      !peer_allowed(getuid(), cred.uid)) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      log().warn("CUDA IPC: refused pool memory to process {} of user {} (only user {} or root)",
                 static_cast<long>(cred.pid), static_cast<unsigned long>(cred.uid),
                 static_cast<unsigned long>(getuid()));
    }
    reply_status(fd, ReplyStatus::refused);
    return false;
  }
  // One receive, not recv_exact: a client that sends its request a little at a time must not hold
  // the server thread for more than the one timeout.
  Request req{};
  if (recv(fd, &req, sizeof req, MSG_WAITALL) != static_cast<ssize_t>(sizeof req) ||
      req.magic != kMagic) {
    return false;
  }
  Pool* pool = nullptr;
  DevPtr base = 0;
  PhysicalLayout layout;
  Reply reply{};
  ReplyStatus refusal = ReplyStatus::ok;
  {
    std::lock_guard lock(s.mu);
    auto it = s.by_id.find(req.export_id);
    if (it == s.by_id.end() || !same_token(it->second->token, req.token) ||
        s.pool->pin(it->second->base) != Status::ok) {
      refusal = ReplyStatus::unknown;
    } else {
      const Export& e = *it->second;
      pool = s.pool;
      base = e.base;
      try {
        layout = e.layout;
      } catch (...) {
        pool->unpin(base);
        refusal = ReplyStatus::failed;
      }
      reply.has_uuid = e.has_uuid ? 1 : 0;
      std::memcpy(reply.uuid, e.uuid.data(), sizeof reply.uuid);
    }
  }
  if (refusal != ReplyStatus::ok) {
    reply_status(fd, refusal);
    return false;
  }
  std::vector<int> fds;
  bool ok = true;
  try {
    fds.reserve(layout.pieces.size());
  } catch (...) {
    ok = false;
  }
  for (std::size_t i = 0; ok && i < layout.pieces.size(); ++i) {
    int pfd = -1;
    if (pool->backend().export_handle(layout.pieces[i].handle, &pfd) != Status::ok) ok = false;
    if (ok) fds.push_back(pfd);
  }
  if (ok) {
    reply.magic = kMagic;
    reply.status = ReplyStatus::ok;
    reply.pieces = static_cast<std::uint32_t>(layout.pieces.size());
    reply.size = layout.size;
    reply.offset = layout.offset;
    ok = send_all(fd, &reply, sizeof reply, nullptr, 0);
    for (std::size_t i = 0; ok && i < fds.size(); i += kPiecesPerMessage) {
      PieceBatch batch{};
      const std::size_t n = std::min(kPiecesPerMessage, fds.size() - i);
      batch.count = static_cast<std::uint32_t>(n);
      for (std::size_t k = 0; k < n; ++k) batch.sizes[k] = layout.pieces[i + k].size;
      ok = send_all(fd, &batch, sizeof batch, fds.data() + i, n);
    }
  } else {
    reply_status(fd, ReplyStatus::failed);
  }
  for (int f : fds) close(f);  // the message holds its own references
  if (!ok) {
    pool->unpin(base);
    return false;
  }
  try {
    std::lock_guard lock(s.mu);  // against fork_child (leases are otherwise the thread's own)
    s.leases.push_back({fd, base});
  } catch (...) {
    pool->unpin(base);
    return false;
  }
  return true;
}

void serve(Server& s, int listen_fd) noexcept {
  std::vector<pollfd> fds;
  for (;;) {
    try {
      std::lock_guard lock(s.mu);
      fds.assign(1, pollfd{listen_fd, POLLIN, 0});
      for (const Lease& l : s.leases) fds.push_back({l.fd, POLLIN, 0});
    } catch (...) {
      usleep(100000);  // out of host memory: try again shortly
      continue;
    }
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      usleep(100000);
      continue;
    }
    // Leases first (their indices match s.leases before any new one is added).
    for (std::size_t i = fds.size(); i-- > 1;) {
      if (fds[i].revents == 0) continue;
      char buf[64];
      ssize_t got = recv(fds[i].fd, buf, sizeof buf, MSG_DONTWAIT);
      if (got > 0 || (got < 0 && (errno == EAGAIN || errno == EINTR))) continue;
      // Closed by the importer (cudaIpcCloseMemHandle, or its process ended).
      Lease lease;
      {
        std::lock_guard lock(s.mu);
        lease = s.leases[i - 1];
        s.leases.erase(s.leases.begin() + static_cast<std::ptrdiff_t>(i - 1));
      }
      close(lease.fd);
      s.pool->unpin(lease.base);
    }
    if (fds[0].revents & POLLIN) {
      int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0 && !serve_request(s, fd)) close(fd);
    }
  }
}

// The program freed a pinned block: withdraw its export and drop the export's pin (the block is
// then freed at once, or when its last importer closes).
void on_pinned_free(DevPtr base, void* context) noexcept {
  auto* s = static_cast<Server*>(context);
  bool exported = false;
  {
    std::lock_guard lock(s->mu);
    auto it = s->by_base.find(base);
    if (it != s->by_base.end()) {
      s->by_id.erase(it->second->id);
      s->by_base.erase(it);
      exported = true;
    }
  }
  if (exported) s->pool->unpin(base);
}

void fork_prepare() noexcept {
  server().mu.lock();
}
void fork_parent() noexcept {
  server().mu.unlock();
}
void fork_child() noexcept {
  Server& s = server();
  // No server thread here, and the exports are the parent's: forget them (the child's pool is
  // out of use after fork, shim.h), and close the child's copies of the sockets, so that the
  // parent's leases end when the parent's importers close, not when this child exits.
  s.by_id.clear();
  s.by_base.clear();
  if (s.listen_fd >= 0) close(s.listen_fd);
  s.listen_fd = -1;
  for (const Lease& l : s.leases) close(l.fd);
  s.leases.clear();
  s.started = false;
  s.pool = nullptr;
  s.mu.unlock();
}

// Binds the socket and starts the thread (s.mu held). False, logged, when it cannot.
bool start_server(Server& s, Pool& pool) noexcept {
  if (s.started) return true;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    log().error("CUDA IPC: cannot create the export socket ({})", std::strerror(errno));
    return false;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const int n = socket_name(addr.sun_path + 1, sizeof addr.sun_path - 1,
                            static_cast<std::uint32_t>(getpid()), getuid());
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 64) != 0) {
    log().error("CUDA IPC: cannot listen on @{} ({})", addr.sun_path + 1, std::strerror(errno));
    close(fd);
    return false;
  }
  static std::once_flag atfork_once;
  std::call_once(atfork_once, [] { pthread_atfork(&fork_prepare, &fork_parent, &fork_child); });
  s.pool = &pool;
  pool.set_pinned_free_handler(&on_pinned_free, &s);
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  try {
    std::thread([&s, fd] {
      pthread_setname_np(pthread_self(), "gpustitch-ipc");
      serve(s, fd);
    }).detach();
  } catch (...) {
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    log().error("CUDA IPC: cannot start the export thread");
    close(fd);
    return false;
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  s.listen_fd = fd;
  s.started = true;
  return true;
}

void fill_handle(const Export& e, void* out) noexcept {
  Handle h{};
  h.magic = kMagic;
  h.version = kVersion;
  h.pid = static_cast<std::uint32_t>(getpid());
  h.uid = getuid();
  h.export_id = e.id;
  std::memcpy(h.token, e.token, sizeof h.token);
  std::memcpy(out, &h, sizeof h);
}

}  // namespace

bool is_pool_handle(const void* handle) noexcept {
  return handle != nullptr && is_ours(handle);
}

Status export_block(Pool& pool, DevPtr ptr, void* handle) noexcept {
  BlockInfo info;
  if (handle == nullptr || !pool.find(ptr, &info)) return Status::invalid_value;
  Server& s = server();
  std::lock_guard lock(s.mu);
  if (auto it = s.by_base.find(info.base); it != s.by_base.end()) {
    fill_handle(*it->second, handle);
    return Status::ok;
  }
  std::unique_ptr<Export> e(new (std::nothrow) Export());
  if (!e) return Status::out_of_memory;
  e->base = info.base;
  Status st = pool.physical_layout(info.base, &e->layout);
  if (st != Status::ok) return st;
  // Whether the backend's handles can be exported at all (one trial export).
  int probe = -1;
  st = pool.backend().export_handle(e->layout.pieces.front().handle, &probe);
  if (probe >= 0) close(probe);
  if (st != Status::ok) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      log().error(
          "CUDA IPC: this driver/device cannot export pool memory as file descriptors; run with "
          "GPUSTITCH_CONF=ipc:native to keep cudaMalloc allocations native so they can be shared");
    }
    return st == Status::not_supported ? st : Status::error;
  }
  if (!start_server(s, pool)) return Status::error;
  e->has_uuid = pool.backend().device_uuid(info.device, &e->uuid) == Status::ok;
  if (!fill_random(e->token, sizeof e->token)) return Status::error;
  e->id = s.next_id++;
  if (pool.pin(info.base) != Status::ok) return Status::invalid_value;
  Export* raw = e.get();
  try {
    s.by_id.emplace(raw->id, raw);
    s.by_base.emplace(info.base, std::move(e));
  } catch (...) {
    s.by_id.erase(raw->id);
    pool.unpin(info.base);
    return Status::out_of_memory;
  }
  fill_handle(*raw, handle);
  static std::atomic<bool> told{false};
  if (!told.exchange(true)) {
    log().warn(
        "CUDA IPC on pool memory: the importing processes must run under gpustitch too "
        "(`gpustitch run`), or this process with GPUSTITCH_CONF=ipc:native; a process without it "
        "gets CUDA's error for an unknown handle");
  }
  return Status::ok;
}

}  // namespace gpustitch::preload::ipc
