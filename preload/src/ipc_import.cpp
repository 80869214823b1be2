// CUDA IPC on pool memory, the importing side: cudaIpcOpenMemHandle/cuIpcOpenMemHandle on a pool
// handle (ipc_protocol.h) and the matching close. See ipc_export.cpp for the design.
//
// Open connects to the exporter's socket, asks for the export with its id and token, receives the
// block's physical handles as file descriptors, imports them (Backend::import_handle:
// cuMemImportFromShareableHandle), reserves a range of this process's own address space, maps
// them side by side, makes the range accessible from the device and returns the block's address
// in it. The connection stays open as the lease: the exporter keeps the memory out of reuse until
// it closes. Close waits for the device (cuMemUnmap does not wait for kernels still using the
// memory), unmaps, releases the imported handles, frees the range and closes the connection.
//
// The device: the exporter's, found by its UUID among this process's devices (ordinals differ
// with CUDA_VISIBLE_DEVICES), else the current one, as CUDA maps an IPC handle in the current
// context. Opening a handle that is open already returns the same address and counts the open;
// each close undoes one. Socket calls time out after 10 seconds, so a stuck exporter makes the
// open fail instead of hanging the program. Nothing here runs on an allocation path.
#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ipc.h"
#include "ipc_protocol.h"
#include "shim.h"

namespace gpustitch::preload::ipc {
namespace {

// A pool block can be stitched from many handles, but not from more than this: a bound on what a
// forged or corrupt reply can make this process allocate.
constexpr std::uint32_t kMaxPieces = 1u << 16;

struct Import {
  std::uint32_t pid = 0;
  std::uint64_t export_id = 0;
  std::uint8_t token[kTokenSize] = {};
  int device = 0;
  DevPtr range = 0;  // this process's reservation
  std::size_t size = 0;
  DevPtr ptr = 0;  // the block, inside range
  std::vector<PhysicalLayout::Piece> pieces;
  int lease_fd = -1;
  unsigned opens = 1;
};

struct Importer {
  std::mutex mu;
  std::unordered_map<DevPtr, std::unique_ptr<Import>> by_ptr;
  std::map<std::pair<std::uint32_t, std::uint64_t>, Import*> by_export;
};

Importer& importer() {
  static Importer* i = new Importer();  // never destroyed, like the rest of the shim
  return *i;
}

void fork_prepare() noexcept {
  importer().mu.lock();
}
void fork_parent() noexcept {
  importer().mu.unlock();
}
void fork_child() noexcept {
  // The child does not use the parent's mappings (CUDA is unusable in a fork()ed child): close
  // its copies of the leases, so that only the parent's close ends them.
  Importer& im = importer();
  for (auto& entry : im.by_ptr) close(entry.second->lease_fd);
  im.by_ptr.clear();
  im.by_export.clear();
  im.mu.unlock();
}

// One batch of piece sizes with its descriptors, appended to *fds (closed by the caller).
bool recv_batch(int fd, PieceBatch* batch, std::vector<int>* fds) noexcept {
  iovec iov{batch, sizeof *batch};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kPiecesPerMessage)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t got;
  do {
    got = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  } while (got < 0 && errno == EINTR);
  std::size_t received = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t k = 0; k < n; ++k) {
      int f;
      std::memcpy(&f, CMSG_DATA(c) + k * sizeof(int), sizeof f);
      try {
        fds->push_back(f);
      } catch (...) {
        close(f);
        return false;
      }
      ++received;
    }
  }
  if (got <= 0 || (msg.msg_flags & MSG_CTRUNC) != 0) return false;
  if (static_cast<std::size_t>(got) < sizeof *batch &&
      !recv_exact(fd, reinterpret_cast<char*>(batch) + got, sizeof *batch - got)) {
    return false;
  }
  return batch->count <= kPiecesPerMessage && received == batch->count;
}

// The exporter's answer: reply, sizes and descriptors. False on any breach of the protocol.
bool fetch(int fd, const Handle& h, Reply* reply, std::vector<PhysicalLayout::Piece>* pieces,
           std::vector<int>* fds) noexcept {
  Request req{};
  req.magic = kMagic;
  req.export_id = h.export_id;
  std::memcpy(req.token, h.token, sizeof req.token);
  if (send(fd, &req, sizeof req, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof req)) return false;
  if (!recv_exact(fd, reply, sizeof *reply) || reply->magic != kMagic) return false;
  if (reply->status != ReplyStatus::ok) return false;
  if (reply->pieces == 0 || reply->pieces > kMaxPieces) return false;
  std::uint64_t sum = 0;
  try {
    pieces->reserve(reply->pieces);
    fds->reserve(reply->pieces);
    while (pieces->size() < reply->pieces) {
      PieceBatch batch{};
      if (!recv_batch(fd, &batch, fds) || batch.count == 0) return false;
      if (pieces->size() + batch.count > reply->pieces) return false;
      for (std::uint32_t k = 0; k < batch.count; ++k) {
        pieces->push_back({0, batch.sizes[k]});
        sum += batch.sizes[k];
      }
    }
  } catch (...) {
    return false;
  }
  return sum == reply->size && reply->offset < reply->size && fds->size() == pieces->size();
}

int device_of(Pool& pool, const Reply& reply, int current_device) noexcept {
  if (reply.has_uuid != 0) {
    for (int d = 0; d < pool.device_count(); ++d) {
      DeviceUuid uuid{};
      if (pool.backend().device_uuid(d, &uuid) == Status::ok &&
          std::memcmp(uuid.data(), reply.uuid, sizeof reply.uuid) == 0) {
        return d;
      }
    }
  }
  return current_device;
}

// Imports, reserves and maps; on failure undoes what it did.
Status map_import(Backend& backend, Import& imp, const std::vector<int>& fds) noexcept {
  const std::size_t n = imp.pieces.size();
  std::size_t imported = 0, mapped = 0;
  Status st = backend.reserve(imp.device, imp.size, &imp.range);
  if (st == Status::ok) {
    for (; imported < n; ++imported) {
      st = backend.import_handle(imp.device, fds[imported], imp.pieces[imported].size,
                                 &imp.pieces[imported].handle);
      if (st != Status::ok) break;
    }
  }
  DevPtr at = imp.range;
  if (st == Status::ok) {
    for (; mapped < n; ++mapped) {
      st = backend.map(at, imp.pieces[mapped].size, imp.pieces[mapped].handle, 0);
      if (st != Status::ok) break;
      at += imp.pieces[mapped].size;
    }
  }
  if (st == Status::ok) {
    const int devices[] = {imp.device};
    st = backend.set_access(imp.range, imp.size, devices);
  }
  if (st == Status::ok) return st;
  for (std::size_t i = mapped; i-- > 0;) {
    at -= imp.pieces[i].size;
    backend.unmap(at, imp.pieces[i].size);
  }
  for (std::size_t i = 0; i < imported; ++i) backend.release(imp.pieces[i].handle);
  if (imp.range != 0) backend.unreserve(imp.range, imp.size);
  return st;
}

void unmap_import(Backend& backend, const Import& imp) noexcept {
  backend.synchronize(imp.device);
  DevPtr at = imp.range;
  for (const auto& p : imp.pieces) {
    backend.unmap(at, p.size);
    at += p.size;
  }
  for (const auto& p : imp.pieces) backend.release(p.handle);
  backend.unreserve(imp.range, imp.size);
}

}  // namespace

Status open_handle(Pool& pool, const void* handle, int current_device, DevPtr* out) noexcept {
  if (handle == nullptr || out == nullptr || !is_ours(handle)) return Status::invalid_value;
  Handle h;
  std::memcpy(&h, handle, sizeof h);
  if (h.version != kVersion || h.pid == 0) return Status::invalid_value;
  Importer& im = importer();
  {
    std::lock_guard lock(im.mu);
    auto it = im.by_export.find({h.pid, h.export_id});
    if (it != im.by_export.end() && std::memcmp(it->second->token, h.token, kTokenSize) == 0) {
      ++it->second->opens;
      *out = it->second->ptr;
      return Status::ok;
    }
  }
  static std::once_flag atfork_once;
  std::call_once(atfork_once, [] { pthread_atfork(&fork_prepare, &fork_parent, &fork_child); });

  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::error;
  set_socket_timeouts(fd, 10);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const int n = socket_name(addr.sun_path + 1, sizeof addr.sun_path - 1, h.pid, h.uid);
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  Reply reply{};
  std::vector<int> fds;
  std::unique_ptr<Import> imp(new (std::nothrow) Import());
  bool ok = imp != nullptr && connect(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
            fetch(fd, h, &reply, &imp->pieces, &fds);
  if (!ok) {
    if (reply.magic == kMagic && reply.status == ReplyStatus::refused) {
      log().error("CUDA IPC: process {} refused its pool memory to this process (another user)",
                  h.pid);
    }
    for (int f : fds) close(f);
    close(fd);
    return Status::invalid_value;  // CUDA's answer for a handle it cannot open
  }
  imp->pid = h.pid;
  imp->export_id = h.export_id;
  std::memcpy(imp->token, h.token, kTokenSize);
  imp->device = device_of(pool, reply, current_device);
  imp->size = reply.size;
  imp->lease_fd = fd;
  Status st = map_import(pool.backend(), *imp, fds);
  for (int f : fds) close(f);
  if (st != Status::ok) {
    close(fd);
    return st;
  }
  imp->ptr = imp->range + reply.offset;
  {
    std::lock_guard lock(im.mu);
    try {
      Import* raw = imp.get();
      im.by_export[{raw->pid, raw->export_id}] = raw;
      try {
        im.by_ptr.emplace(raw->ptr, std::move(imp));
      } catch (...) {
        im.by_export.erase({raw->pid, raw->export_id});
        throw;
      }
      *out = raw->ptr;
      return Status::ok;
    } catch (...) {
    }
  }
  unmap_import(pool.backend(), *imp);
  close(fd);
  return Status::out_of_memory;
}

bool close_handle(Pool& pool, DevPtr ptr, Status* status) noexcept {
  Importer& im = importer();
  std::unique_ptr<Import> imp;
  {
    std::lock_guard lock(im.mu);
    auto it = im.by_ptr.find(ptr);
    if (it == im.by_ptr.end()) return false;
    *status = Status::ok;
    if (--it->second->opens != 0) return true;
    imp = std::move(it->second);
    im.by_ptr.erase(it);
    im.by_export.erase({imp->pid, imp->export_id});
  }
  unmap_import(pool.backend(), *imp);
  close(imp->lease_fd);  // ends the lease: the exporter may reuse the memory once it sees this
  return true;
}

}  // namespace gpustitch::preload::ipc
