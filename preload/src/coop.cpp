// Cooperative release: processes sharing a GPU give idle cached memory to the one about to fail.
//
// Giving. With coop:on (the default), the shim starts one thread, "gpustitch-coop", that listens
// on the process's coop socket (shared/coop/channel.h: an abstract Unix datagram name made of the
// pid and start time of its statistics record). A request names a GPU by UUID and a byte count.
// The thread accepts it only from its own uid, root, or gpustitchd's user (the owner of the
// daemon's socket), as the kernel attests with SCM_CREDENTIALS, spends one token of a bucket
// refilled at coop_rate per second (a flood is dropped and counted, never served), and calls
// Pool::release_idle, which releases idle, fenced cache only (never a live block) taking the device
// lock once per released range, so the program's own allocations are never held up for long. It
// replies with the bytes released and records a coop_give event with the asker's pid. The thread
// does nothing else; it blocks all signals and never touches the program's state beyond the pool.
//
// Asking. When the pool reports out-of-memory (after stitching and trimming its own cache), the
// allocating thread looks for neighbours without any daemon: the calling user's statistics
// records in /dev/shm whose device with the same UUID holds cached memory, largest first. It
// asks each for a share of what is missing (the request rounded to the granularity minus the
// device's free memory), from an autobound socket, waits up to coop_wait_ms for the replies, and
// retries the allocation once if anything was released; otherwise the caller gets the native
// out-of-memory error as before. No pool lock is held while waiting, so a neighbour asking this
// process at the same moment is served by this process's listener. Each reply that released
// memory becomes a coop_receive event. Neighbours of other users are reached only through
// gpustitchd (daemon/src/coop_relay.h), which runs as root and may ask them: if the own user's
// neighbours did not give enough, the process asks the daemon on its socket ($GPUSTITCH_SOCKET or
// /run/gpustitch/gpustitchd.sock) within the same coop_wait_ms, then watches the device's free
// memory; what appears counts as one coop_receive with peer pid 0 (through the daemon).
//
// Discovery needs the peers' statistics records (publish:on, the default). Counters (bytes given
// and received, requests served and dropped) go into the record's coop_* fields per device;
// requests that name no device of this process (malformed, foreign GPU) count on device 0.
#include "coop.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "gpustitch/coop/channel.h"
#include "gpustitch/shm/names.h"
#include "gpustitch/shm/record_reader.h"

namespace gpustitch::preload {
namespace {

struct Counters {
#define GPUSTITCH_COOP_ATOMIC(name) std::atomic<std::uint64_t> name{0};
  GPUSTITCH_SHM_COOP_COUNTERS(GPUSTITCH_COOP_ATOMIC)
#undef GPUSTITCH_COOP_ATOMIC
};
Counters g_counters[shm::kMaxDevices];

std::atomic<bool> g_enabled{false};
unsigned g_wait_ms = 50;
std::atomic<shm::StatsPublisher*> g_publisher{nullptr};
constexpr std::size_t kMaxPeersAsked = 16;

Counters& counters(int device) {
  return g_counters[device >= 0 && device < shm::kMaxDevices ? device : 0];
}

void record(shm::RecordEventKind kind, int device, std::uint64_t size, std::uint64_t peer,
            Pool& pool) noexcept {
  shm::StatsPublisher* p = g_publisher.load(std::memory_order_acquire);
  if (p == nullptr) return;
  shm::RecordEvent e;
  e.kind = kind;
  e.device = device;
  e.size = size;
  e.peer_pid = peer;
  std::size_t free = 0, total = 0;
  if (pool.backend().mem_info(device, &free, &total) == Status::ok) e.device_free = free;
  p->record_event(e);
}

int device_of(Pool& pool, const std::uint8_t (&uuid)[coop::kUuidBytes]) noexcept {
  for (int d = 0; d < pool.device_count(); ++d) {
    DeviceUuid u{};
    if (pool.backend().device_uuid(d, &u) == Status::ok &&
        std::memcmp(u.data(), uuid, coop::kUuidBytes) == 0) {
      return d;
    }
  }
  return -1;
}

std::string daemon_socket_path() {
  const char* env = std::getenv("GPUSTITCH_SOCKET");
  return env != nullptr && *env ? env : "/run/gpustitch/gpustitchd.sock";
}

// Who may ask this process to release: its own user, root, and gpustitchd, which runs as a
// system user of its own: the owner of the daemon's socket (only that user can create it in its
// runtime directory).
bool may_ask(const coop::Peer& sender) noexcept {
  if (!sender.has_credentials) return false;
  if (sender.uid == ::geteuid() || sender.uid == 0) return true;
  try {
    struct stat st {};
    return ::stat(daemon_socket_path().c_str(), &st) == 0 && S_ISSOCK(st.st_mode) &&
           st.st_uid == sender.uid;
  } catch (...) {
    return false;
  }
}

void serve(Pool& pool, const coop::Socket& sock, const coop::Received& r,
           coop::TokenBucket& bucket) noexcept {
  const bool permitted = may_ask(r.sender);
  const coop::Message* m = r.message ? &*r.message : nullptr;
  if (m == nullptr || m->kind != coop::Kind::request || !permitted) {
    ++counters(0).coop_requests;
    ++counters(0).coop_dropped;
    return;  // no reply: nothing to tell a sender that may not ask, or speaks no protocol
  }
  coop::Message reply;
  reply.kind = coop::Kind::reply;
  reply.id = m->id;
  std::memcpy(reply.uuid, m->uuid, coop::kUuidBytes);
  const int device = device_of(pool, m->uuid);
  Counters& c = counters(device);
  ++c.coop_requests;
  if (device < 0) {
    reply.status = coop::ReplyStatus::no_device;
  } else if (!bucket.take(coop::monotonic_ns())) {
    ++c.coop_dropped;
    reply.status = coop::ReplyStatus::rate_limited;
  } else {
    const std::size_t released = pool.release_idle(device, m->bytes);
    reply.bytes = released;
    if (released != 0) {
      ++c.coop_gives;
      c.coop_given_bytes += released;
      // The process that needs the memory: the sender, unless root (gpustitchd) relays for it.
      const std::uint64_t peer = r.sender.uid == 0 && m->origin_pid > 0
                                     ? static_cast<std::uint64_t>(m->origin_pid)
                                     : static_cast<std::uint64_t>(r.sender.pid);
      record(shm::RecordEventKind::coop_give, device, released, peer, pool);
    }
  }
  sock.send_to(r.from, r.from_len, reply);
}

void listen_loop(Pool* pool, coop::Socket* sock, unsigned rate) noexcept {
  coop::TokenBucket bucket(rate, rate);
  for (;;) {
    auto r = sock->receive(-1);
    if (!r) {
      ::usleep(10000);  // a persistent socket error must not spin a core
      continue;
    }
    serve(*pool, *sock, *r, bucket);
  }
}

struct Candidate {
  pid_t pid;
  std::uint64_t start_time;
  std::uint64_t cached;
};

// The calling user's other processes with cached memory on the GPU with this UUID.
std::vector<Candidate> find_neighbours(const DeviceUuid& uuid) {
  std::vector<Candidate> out;
  const pid_t self = ::getpid();
  const uid_t uid = ::geteuid();
  for (const shm::RecordName& name : shm::discover_records(shm::kDefaultPrefix, uid)) {
    if (name.pid == self || !shm::record_process_alive(name)) continue;
    shm::ReadError err{};
    auto reader = shm::RecordReader::open(name, uid, &err);
    if (!reader) continue;
    shm::SnapshotCopy snap;
    if (reader->read_snapshot(&snap) != shm::ReadError::none) continue;
    for (const auto& d : snap.devices) {
      if (std::memcmp(d.uuid, uuid.data(), shm::kUuidBytes) == 0 && d.releasable_bytes() > 0) {
        out.push_back({name.pid, name.start_time, d.releasable_bytes()});
        break;
      }
    }
  }
  std::sort(out.begin(), out.end(),
            [](const Candidate& a, const Candidate& b) { return a.cached > b.cached; });
  if (out.size() > kMaxPeersAsked) out.resize(kMaxPeersAsked);
  return out;
}

// Asks gpustitchd to relay a request to other users' processes on this GPU (they accept
// requests only from root). Returns how many processes it asked; 0 when no daemon answers in
// time. The exchange is one JSON line each way on the daemon's socket.
int ask_daemon(const DeviceUuid& uuid, std::size_t bytes, int timeout_ms) {
  const std::string path = daemon_socket_path();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return 0;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  int asked = 0;
  char line[160];
  const auto* u = uuid.data();
  int n =
      std::snprintf(line, sizeof line,
                    "{\"cmd\":\"coop_release\",\"uuid\":\"GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-"
                    "%02x%02x-%02x%02x%02x%02x%02x%02x\",\"bytes\":%zu}\n",
                    u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12],
                    u[13], u[14], u[15], bytes);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::send(fd, line, static_cast<std::size_t>(n), MSG_NOSIGNAL) == n) {
    std::string reply;
    const std::uint64_t deadline = coop::monotonic_ns() + std::uint64_t(timeout_ms) * 1000000;
    char buf[256];
    while (reply.find('\n') == std::string::npos && reply.size() < 4096) {
      const std::uint64_t now = coop::monotonic_ns();
      if (now >= deadline) break;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>((deadline - now) / 1000000 + 1)) <= 0) break;
      ssize_t got = ::recv(fd, buf, sizeof buf, 0);
      if (got <= 0) break;
      reply.append(buf, static_cast<std::size_t>(got));
    }
    if (auto pos = reply.find("\"asked\":"); pos != std::string::npos) {
      asked = std::atoi(reply.c_str() + pos + 8);
    }
  }
  ::close(fd);
  return asked;
}

// Asks the neighbours for what an allocation of size bytes lacks. Returns the bytes released.
std::size_t ask_neighbours(Pool& pool, int device, std::size_t size) noexcept {
  try {
    DeviceUuid uuid{};
    if (pool.backend().device_uuid(device, &uuid) != Status::ok) return 0;
    const std::size_t g = std::max<std::size_t>(pool.backend().granularity(device), 1);
    std::size_t free = 0, total = 0;
    if (pool.backend().mem_info(device, &free, &total) != Status::ok) free = 0;
    const std::size_t rounded = (size + g - 1) / g * g;
    const std::size_t need = rounded > free ? rounded - free : g;
    Counters& c = counters(device);
    ++c.coop_asks;
    const std::uint64_t deadline = coop::monotonic_ns() + std::uint64_t{g_wait_ms} * 1000000;
    std::vector<Candidate> peers = find_neighbours(uuid);
    auto sock = coop::Socket::ephemeral();
    if (!sock) return 0;
    coop::Message m;
    m.kind = coop::Kind::request;
    m.id = coop::monotonic_ns() ^ (static_cast<std::uint64_t>(::getpid()) << 32);
    std::memcpy(m.uuid, uuid.data(), coop::kUuidBytes);
    m.origin_pid = ::getpid();
    std::size_t remaining = need, sent = 0;
    for (const Candidate& p : peers) {
      if (remaining == 0) break;
      m.bytes = std::min<std::uint64_t>(p.cached, remaining);
      if (sock->send_to(p.pid, p.start_time, m)) {
        remaining -= m.bytes;
        ++sent;
      }
    }
    std::size_t got = 0, replies = 0;
    while (replies < sent && got < need) {
      const std::uint64_t now = coop::monotonic_ns();
      if (now >= deadline) break;
      auto r = sock->receive(static_cast<int>((deadline - now + 999999) / 1000000));
      if (!r) break;
      if (!r->message || r->message->kind != coop::Kind::reply || r->message->id != m.id) {
        continue;
      }
      ++replies;
      if (r->message->status == coop::ReplyStatus::ok && r->message->bytes != 0) {
        got += r->message->bytes;
        ++c.coop_receives;
        c.coop_received_bytes += r->message->bytes;
        record(shm::RecordEventKind::coop_receive, device, r->message->bytes,
               static_cast<std::uint64_t>(r->sender.pid), pool);
      }
    }
    if (got >= need) return got;
    // Other users' processes: only through gpustitchd. Then watch the device's free memory.
    const std::uint64_t now = coop::monotonic_ns();
    if (now >= deadline) return got;
    const int left_ms = static_cast<int>((deadline - now) / 1000000);
    if (ask_daemon(uuid, need - got, left_ms) <= 0) return got;
    std::size_t free_now = free;
    while (coop::monotonic_ns() < deadline) {
      if (pool.backend().mem_info(device, &free_now, &total) == Status::ok && free_now >= rounded) {
        break;
      }
      ::usleep(2000);
    }
    if (free_now > free) {
      const std::size_t relayed = free_now - free;
      ++c.coop_receives;
      c.coop_received_bytes += relayed;
      record(shm::RecordEventKind::coop_receive, device, relayed, 0, pool);  // peer 0: gpustitchd
      got += relayed;
    }
    return got;
  } catch (...) {
    return 0;
  }
}

// The pool's out-of-memory handler: the pool retries once when neighbours released something, and
// counts an out-of-memory only when the caller finally gets one.
bool ask_on_out_of_memory(int device, std::size_t size, void* pool) noexcept {
  if (!g_enabled.load(std::memory_order_acquire)) return false;
  return ask_neighbours(*static_cast<Pool*>(pool), device, size) != 0;
}

}  // namespace

void start_coop(const Config& config, Pool& pool, shm::StatsPublisher* publisher) noexcept {
  if (!config.coop) return;
  g_wait_ms = config.coop_wait_ms;
  g_publisher.store(publisher, std::memory_order_release);
  auto start = shm::process_start_time(0);
  if (!start) return;
  auto sock = coop::Socket::listen(::getpid(), *start);
  // Without a listener the process still asks: giving and asking are independent.
  g_enabled.store(true, std::memory_order_release);
  pool.set_out_of_memory_handler(&ask_on_out_of_memory, &pool);
  if (!sock) return;
  auto* owned = new (std::nothrow) coop::Socket(std::move(*sock));  // lives as long as the thread
  if (owned == nullptr) return;
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  try {
    std::thread([p = &pool, owned, rate = config.coop_rate] {
      pthread_setname_np(pthread_self(), "gpustitch-coop");
      listen_loop(p, owned, rate);
    }).detach();
  } catch (...) {
    delete owned;
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

void fill_coop_counters(int device, shm::DeviceCounters& out) noexcept {
  if (device < 0 || device >= shm::kMaxDevices) return;
  const Counters& c = g_counters[device];
#define GPUSTITCH_COOP_COPY(name) out.name = c.name.load(std::memory_order_relaxed);
  GPUSTITCH_SHM_COOP_COUNTERS(GPUSTITCH_COOP_COPY)
#undef GPUSTITCH_COOP_COPY
}

}  // namespace gpustitch::preload
