// Cooperative release between processes on one (simulated, shared) GPU, through the real
// LD_PRELOAD of libgpustitch.so: a process about to fail gets the idle cache of its neighbour;
// opting out, floods and hostile requests cannot make a process free live memory.
//
// Each test starts coop_peer processes on a fresh shared simulated device (sim_shared:NAME,
// 512 MiB) and drives them over pipes; the test process itself plays the hostile sender. The
// askers wait up to 2 s (coop_wait_ms) so that a loaded CI machine cannot fail them; they stop
// waiting as soon as the answers are in.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpustitch/coop/channel.h"
#include "gpustitch/shm/names.h"
#include "gpustitch/shm/record_reader.h"
#include "gpustitch/sim_backend.h"
#include "subprocess.h"

using namespace gpustitch;

namespace {

constexpr std::uint64_t MiB_ = 1ull << 20;

class Peer {
 public:
  explicit Peer(const std::string& conf) {
    int in[2], out[2];
    EXPECT_EQ(pipe2(in, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(out, O_CLOEXEC), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    std::vector<std::string> env = {
        std::string("LD_PRELOAD=") + PRELOAD,
        std::string("LD_LIBRARY_PATH=") + RUNTIME_DIR + ":" + DRIVER_DIR, "GPUSTITCH_CONF=" + conf,
        "PATH=/usr/bin:/bin"};
    if (const char* asan = std::getenv("ASAN_OPTIONS"))
      env.push_back(std::string("ASAN_OPTIONS=") + asan);
    std::vector<char*> envp, argv;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = subprocess::emulated({PEER_PATH});
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    EXPECT_EQ(posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), envp.data()), 0);
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    to_ = in[1];
    from_ = out[0];
  }
  ~Peer() {
    if (pid_ > 0) {
      (void)!write(to_, "exit\n", 5);
      close(to_);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
    close(from_);
  }
  pid_t pid() const { return pid_; }
  // Sends a command; returns its one-line answer ("" after 10 s).
  std::string cmd(const std::string& c) {
    std::string line = c + "\n";
    if (write(to_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return "";
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{from_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char ch;
      if (read(from_, &ch, 1) != 1) break;
      if (ch == '\n') return out;
      out += ch;
    }
    return out;
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
};

// The value of key=... in a line, or -1.
long long field(const std::string& line, const std::string& key) {
  auto pos = line.find(key + "=");
  if (pos == std::string::npos) return -1;
  return std::stoll(line.substr(pos + key.size() + 1));
}

struct Device {
  std::string name;
  Device() : name("coop-test-" + std::to_string(getpid()) + "-" + std::to_string(counter()++)) {
    SimBackend::unlink_shared(name);
  }
  ~Device() { SimBackend::unlink_shared(name); }
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::string conf(const std::string& extra = "") const {
    return "backend:sim,sim_capacity_mb:512,sim_shared:" + name +
           ",publish_interval_ms:10,log_level:off,coop_wait_ms:2000" +
           (extra.empty() ? "" : "," + extra);
  }
};

// The published counters of pid's device 0, once its record shows at least min_cached cached.
std::optional<shm::DeviceCounters> wait_for_cached(pid_t pid, std::uint64_t min_cached) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    for (const auto& n : shm::discover_records(shm::kDefaultPrefix, geteuid())) {
      if (n.pid != pid) continue;
      shm::ReadError err{};
      auto r = shm::RecordReader::open(n, geteuid(), &err);
      shm::SnapshotCopy snap;
      if (r && r->read_snapshot(&snap) == shm::ReadError::none && !snap.devices.empty() &&
          snap.devices[0].bytes_cached >= min_cached) {
        return snap.devices[0];
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return std::nullopt;
}

// A holds 64 MiB live (id 0) and, after freeing them, six 64 MiB blocks idle in its cache:
// 448 of the device's 512 MiB.
void fill_holder(Peer& a) {
  for (int i = 0; i < 7; ++i) ASSERT_EQ(field(a.cmd("alloc 64"), "rc"), 0) << i;
  for (int i = 1; i < 7; ++i) ASSERT_EQ(a.cmd("free " + std::to_string(i)), "free rc=0");
  ASSERT_TRUE(wait_for_cached(a.pid(), 384 * MiB_));
}

// The listener's queue holds a few datagrams; under load a send may find it full (EAGAIN).
template <typename Send>
bool with_retries(Send send) {
  for (int i = 0; i < 2000; ++i) {
    if (send()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

coop::Message request_for(const shm::DeviceCounters& d, std::uint64_t bytes, std::uint64_t id) {
  coop::Message m;
  m.kind = coop::Kind::request;
  m.id = id;
  std::memcpy(m.uuid, d.uuid, coop::kUuidBytes);
  m.bytes = bytes;
  m.origin_pid = getpid();
  return m;
}

}  // namespace

TEST(Coop, ANeighboursIdleCacheServesAnAllocationThatWouldFail) {
  Device dev;
  Peer a(dev.conf());
  Peer b(dev.conf());
  fill_holder(a);
  // B initialises its shim first, so that the time measured below is the asking alone.
  ASSERT_EQ(field(b.cmd("alloc 1"), "rc"), 0);
  ASSERT_EQ(b.cmd("free 0"), "free rc=0");
  // 192 MiB: more than the 64 MiB the device has free; B's own cache is trimmed first.
  std::string r = b.cmd("alloc 192");
  EXPECT_EQ(field(r, "rc"), 0) << r;  // cudaSuccess
  EXPECT_EQ(b.cmd("check"), "check ok=1");
  EXPECT_EQ(a.cmd("check"), "check ok=1");  // A's live block kept its bytes
  // A released about what B lacked (three 64 MiB views for 128 MiB missing... at least 128).
  std::string ea = a.cmd("events");
  std::string eb = b.cmd("events");
  EXPECT_EQ(field(ea, "give"), 1) << ea;
  EXPECT_GE(field(ea, "give_bytes"), static_cast<long long>(128 * MiB_)) << ea;
  EXPECT_LE(field(ea, "give_bytes"), static_cast<long long>(384 * MiB_)) << ea;
  EXPECT_EQ(field(ea, "give_peer"), b.pid()) << ea;
  EXPECT_EQ(field(eb, "receive"), 1) << eb;
  EXPECT_EQ(field(eb, "receive_bytes"), field(ea, "give_bytes")) << eb;
  EXPECT_EQ(field(eb, "receive_peer"), a.pid()) << eb;
  std::string cb = b.cmd("counters");
  EXPECT_EQ(field(cb, "asks"), 1) << cb;
  EXPECT_EQ(field(cb, "received"), field(ea, "give_bytes")) << cb;
  std::string ca = a.cmd("counters");
  EXPECT_EQ(field(ca, "requests"), 1) << ca;
  EXPECT_EQ(field(ca, "given"), field(ea, "give_bytes")) << ca;
  std::printf("B's cudaMalloc took %.1f ms, with %lld MiB released by A\n",
              static_cast<double>(field(r, "us")) / 1000.0, field(ea, "give_bytes") >> 20);
}

TEST(Coop, AProcessThatOptedOutGivesNothingAndTheAskerGetsTheNativeError) {
  Device dev;
  Peer a(dev.conf("coop:off"));
  Peer b(dev.conf());
  fill_holder(a);
  std::string r = b.cmd("alloc 192");
  EXPECT_EQ(field(r, "rc"), 2) << r;  // cudaErrorMemoryAllocation
  EXPECT_EQ(a.cmd("check"), "check ok=1");
  EXPECT_EQ(field(a.cmd("events"), "give"), 0);
  EXPECT_TRUE(wait_for_cached(a.pid(), 384 * MiB_));  // A's cache is untouched
}

TEST(Coop, AnAskerThatOptedOutDoesNotAsk) {
  Device dev;
  Peer a(dev.conf());
  Peer b(dev.conf("coop:off"));
  fill_holder(a);
  EXPECT_EQ(field(b.cmd("alloc 192"), "rc"), 2);
  EXPECT_EQ(field(a.cmd("events"), "give"), 0);
}

// A holder process ready to be sent raw requests: its cache filled and published, its start time
// (which requests must name) and a socket to send from.
struct Target {
  explicit Target(Peer& peer) {
    fill_holder(peer);
    counters = wait_for_cached(peer.pid(), 384 * MiB_);
    start = shm::process_start_time(peer.pid());
    sock = coop::Socket::ephemeral();
    why = !counters ? "the holder's cache was never published"
          : !start  ? "no start time for the holder"
          : !sock   ? "no socket"
                    : "";
  }
  bool ready() const { return why.empty(); }
  decltype(wait_for_cached(0, 0)) counters;
  decltype(shm::process_start_time(0)) start;
  decltype(coop::Socket::ephemeral()) sock;
  std::string why;
};

TEST(Coop, AFloodOfRequestsIsRateLimited) {
  Device dev;
  Peer a(dev.conf("coop_rate:2"));
  Target t(a);
  ASSERT_TRUE(t.ready()) << t.why;
  const auto& counters = t.counters;
  const auto& start = t.start;
  auto& sock = t.sock;
  constexpr int kFlood = 50;
  const auto t0 = std::chrono::steady_clock::now();
  int ok = 0, limited = 0, replies = 0;
  std::uint64_t released = 0;
  // Replies are drained while sending: the listener never blocks on a slow asker, so replies
  // that find this socket's queue full are dropped.
  auto drain = [&](int timeout_ms) {
    while (auto r = sock->receive(timeout_ms)) {
      ASSERT_TRUE(r->message);
      ++replies;
      if (r->message->status == coop::ReplyStatus::ok) ++ok, released += r->message->bytes;
      if (r->message->status == coop::ReplyStatus::rate_limited) ++limited;
      if (replies == kFlood) return;
    }
  };
  for (int i = 0; i < kFlood; ++i) {
    // The listener's queue holds a few datagrams: a full queue (EAGAIN) is retried.
    int tries = 0;
    while (!sock->send_to(a.pid(), *start, request_for(*counters, 64 * MiB_, 1000 + i))) {
      ASSERT_LT(++tries, 1000);
      drain(1);
    }
    drain(0);
  }
  drain(2000);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // A's own counters are the truth (a reply that finds this socket's queue full is dropped by
  // design: the listener never blocks on an asker). Burst 2, refilled at 2 per second while the
  // flood was being served.
  std::string c = a.cmd("counters");
  const long long gives = field(c, "gives");
  EXPECT_EQ(field(c, "requests"), kFlood) << c;
  EXPECT_GE(gives, 1) << c;
  EXPECT_LE(gives, 2 + static_cast<long long>(2 * seconds) + 1) << c << " in " << seconds << " s";
  EXPECT_EQ(field(c, "dropped"), kFlood - gives) << c;
  EXPECT_EQ(field(c, "given"), gives * static_cast<long long>(64 * MiB_)) << c;
  EXPECT_LE(ok, gives);
  EXPECT_LE(limited, kFlood - gives);
  EXPECT_EQ(released, static_cast<std::uint64_t>(ok) * 64 * MiB_);
  EXPECT_EQ(a.cmd("check"), "check ok=1");
  std::printf("flood of %d: %lld served, %lld dropped in %.3f s\n", kFlood, gives,
              field(c, "dropped"), seconds);
}

TEST(Coop, HostileRequestsCannotFreeLiveMemoryOrCrashTheProcess) {
  Device dev;
  Peer a(dev.conf());
  Target t(a);
  ASSERT_TRUE(t.ready()) << t.why;
  const auto& counters = t.counters;
  const auto& start = t.start;
  auto& sock = t.sock;
  // Garbage of every length, a valid header with bad fields, oversized datagrams.
  std::mt19937 rng(7);
  int sent = 0;
  for (std::size_t len : {0, 1, 8, 63, 64, 65, 200, 4096}) {
    std::vector<std::uint8_t> junk(len);
    for (auto& b : junk) b = static_cast<std::uint8_t>(rng());
    if (with_retries([&] { return sock->send_raw(a.pid(), *start, junk.data(), junk.size()); }))
      ++sent;
  }
  std::uint8_t good[coop::kMessageBytes];
  coop::encode(request_for(*counters, 64 * MiB_, 1), good);
  for (auto [off, value] :
       std::vector<std::pair<int, std::uint8_t>>{{4, 9} /* version */,
                                                 {6, 7} /* kind */,
                                                 {39, 0x40} /* bytes > 2^50 */,
                                                 {43, 0x80} /* negative origin */,
                                                 {44, 1} /* status in a request */}) {
    std::uint8_t bad[coop::kMessageBytes];
    std::memcpy(bad, good, sizeof bad);
    bad[off] = value;
    if (with_retries([&] { return sock->send_raw(a.pid(), *start, bad, sizeof bad); })) ++sent;
  }
  // A reply sent as if it were a request.
  coop::Message reply = request_for(*counters, 64 * MiB_, 2);
  reply.kind = coop::Kind::reply;
  if (with_retries([&] { return sock->send_to(a.pid(), *start, reply); })) ++sent;
  // A well-formed request carrying a file descriptor: the descriptor must not leak into A.
  {
    int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    std::uint8_t buf[coop::kMessageBytes];
    coop::Message m = request_for(*counters, 0, 3);
    std::memcpy(m.uuid, "not-this-gpu....", 16);
    coop::encode(m, buf);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::string name = coop::listener_name(a.pid(), *start);
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    iovec iov{buf, sizeof buf};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_name = &addr;
    msg.msg_namelen = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
    EXPECT_TRUE(with_retries(
        [&] { return sendmsg(sock->fd(), &msg, 0) == static_cast<ssize_t>(sizeof buf); }));
    close(fd);
    auto r = sock->receive(2000);  // answered: no such device here
    ASSERT_TRUE(r && r->message);
    EXPECT_EQ(r->message->status, coop::ReplyStatus::no_device);
  }
  // None of the malformed ones got an answer or released anything.
  EXPECT_FALSE(sock->receive(200));
  EXPECT_EQ(a.cmd("check"), "check ok=1");
  auto after = wait_for_cached(a.pid(), 384 * MiB_);
  ASSERT_TRUE(after);
  EXPECT_EQ(after->bytes_reserved, counters->bytes_reserved);
  std::string c = a.cmd("counters");
  EXPECT_EQ(field(c, "dropped"), sent) << c;
  EXPECT_EQ(field(c, "given"), 0) << c;

  // Another user: the kernel says who sent it, and A refuses (needs root to become someone else).
  if (geteuid() == 0) {
    pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
      auto s = coop::Socket::ephemeral();
      if (!s || !with_retries([&] {
            return s->send_to(a.pid(), *start, request_for(*counters, 1ull << 40, 4));
          }))
        _exit(4);
      _exit(s->receive(500) ? 5 : 0);  // no reply expected
    }
    int status = 0;
    waitpid(child, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    std::string c2 = a.cmd("counters");
    EXPECT_EQ(field(c2, "dropped"), sent + 1) << c2;
    EXPECT_EQ(field(c2, "given"), 0) << c2;
  }
  // Still alive and serving: a legitimate request for everything releases the idle cache only.
  ASSERT_TRUE(with_retries(
      [&] { return sock->send_to(a.pid(), *start, request_for(*counters, 1ull << 40, 5)); }));
  auto r = sock->receive(2000);
  ASSERT_TRUE(r && r->message);
  EXPECT_EQ(r->message->status, coop::ReplyStatus::ok);
  EXPECT_EQ(r->message->bytes, 384 * MiB_);
  EXPECT_EQ(a.cmd("check"), "check ok=1");
  if (geteuid() != 0) {
    GTEST_SKIP() << "the other-user part needs root (setuid to nobody); the rest ran";
  }
}

// The out-of-memory line names the processes holding the most of the GPU, from their statistics
// records: here a neighbour with 300 MiB live on the shared device, ahead of the failing process.
TEST(Coop, OutOfMemoryLineNamesTheProcessesHoldingTheGpu) {
  Device dev;
  Peer a(dev.conf());
  ASSERT_EQ(field(a.cmd("alloc 300"), "rc"), 0);
  // Wait until A's record shows it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  bool published = false;
  while (!published && std::chrono::steady_clock::now() < deadline) {
    for (const auto& n : shm::discover_records(shm::kDefaultPrefix, geteuid())) {
      shm::ReadError err{};
      auto r = n.pid == a.pid() ? shm::RecordReader::open(n, geteuid(), &err) : std::nullopt;
      shm::SnapshotCopy snap;
      if (r && r->read_snapshot(&snap) == shm::ReadError::none && !snap.devices.empty() &&
          snap.devices[0].bytes_reserved >= 300 * MiB_) {
        published = true;
      }
    }
    if (!published) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(published);
  subprocess::Result r =
      subprocess::run({PROBE_PATH, "oom", "400", "0"},
                      {std::string("LD_PRELOAD=") + PRELOAD,
                       std::string("LD_LIBRARY_PATH=") + RUNTIME_DIR + ":" + DRIVER_DIR,
                       "GPUSTITCH_CONF=" + dev.conf("coop:off,log_level:error")});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("oom_rc=2"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("verdict: real shortage"), std::string::npos) << r.err;
  const std::string first = "holding most on this GPU: pid " + std::to_string(a.pid()) + " (";
  EXPECT_NE(r.err.find(first), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("coop_peer"), std::string::npos) << r.err;  // A's command
  EXPECT_NE(r.err.find("(this process)"), std::string::npos) << r.err;
}
