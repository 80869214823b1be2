// gpustitchd as a process, against what careless or hostile local users do to it: files planted at
// its socket path, a second instance, bad paths on the command line and on reload. Every daemon
// here uses a socket in a fresh temporary directory and a record prefix of its own, so it never
// touches the records or the socket of a real daemon on the machine.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "gpustitch/shm/json.h"
#include "process_helpers.h"
#include "test_helpers.h"

using namespace gpustitch;
using nlohmann::json;
using namespace std::chrono_literals;
using test::Child;
using test::eventually;

namespace {

// Waits for the child to exit within limit; its exit status (128 + signal when killed), or
// nullopt when it still ran (it is then killed).
std::optional<int> wait_exit(Child& c, std::chrono::milliseconds limit) {
  int status = 0;
  bool done = eventually(
      [&] {
        pid_t r = ::waitpid(c.pid, &status, WNOHANG);
        return r == c.pid;
      },
      limit, 20ms);
  if (!done) {
    test::kill_child(c);
    return std::nullopt;
  }
  if (c.out >= 0) ::close(c.out);
  c = {};
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class HostileDaemon : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/gstest-hostile-XXXXXX";
    ASSERT_TRUE(::mkdtemp(tmpl));
    dir_ = tmpl;
    ::chmod(dir_.c_str(), 0755);  // other users must reach the socket
    socket_ = dir_ + "/d.sock";
  }
  void TearDown() override {
    for (auto& c : daemons_) test::kill_child(c);
    std::filesystem::remove_all(dir_);
  }

  // gpustitchd with these arguments, its stderr in a file of its own (see log()), no config
  // file unless args name one.
  Child start(std::vector<std::string> args, bool with_config_default = true) {
    std::vector<std::string> argv{GPUSTITCHD};
    if (with_config_default) argv.insert(argv.end(), {"--config", ""});
    argv.insert(argv.end(), {"--set", "record_prefix=" + g_.prefix});
    argv.insert(argv.end(), args.begin(), args.end());
    std::string err = dir_ + "/stderr." + std::to_string(daemons_.size());
    Child c = test::spawn(argv, {}, -1, -1, err);
    daemons_.push_back(c);
    logs_.push_back(err);
    return c;
  }
  std::string log(std::size_t i) { return slurp(logs_.at(i)); }
  // The exit status of daemon i within the limit (nullopt: it kept running).
  std::optional<int> exit_of(std::size_t i, std::chrono::milliseconds limit = 10s) {
    return wait_exit(daemons_.at(i), limit);
  }
  bool pings(const std::string& socket) {
    return shm::query_daemon(socket, {{"cmd", "ping"}}, 2000, nullptr).has_value();
  }
  std::optional<long> ping_pid(const std::string& socket) {
    auto j = shm::query_daemon(socket, {{"cmd", "ping"}}, 2000, nullptr);
    if (!j || !j->contains("pid")) return std::nullopt;
    return (*j)["pid"].get<long>();
  }

  test::PrefixGuard g_;
  std::string dir_, socket_;
  std::vector<Child> daemons_;
  std::vector<std::string> logs_;
};

// A loopback port nobody listens on (a race with other programs is possible but harmless here:
// the tests that need a free port would fail loudly, not wrongly pass).
int free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

// A connected loopback TCP socket, or -1.
int tcp_connect(int port) {
  int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(s);
    return -1;
  }
  return s;
}

std::string http(int port, const std::string& request) {
  int s = tcp_connect(port);
  if (s < 0) return {};
  timeval tv{5, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  (void)!::write(s, request.data(), request.size());
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(s, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(s);
  return out;
}

std::string http_get(int port, const std::string& path) {
  return http(port, "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
}

// Descriptors the process has open.
std::size_t open_fds(pid_t pid) {
  std::error_code ec;
  std::size_t n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++n;
  return n;
}

// User plus system CPU time of the process, in seconds (from /proc/<pid>/stat).
double cpu_seconds(pid_t pid) {
  std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  std::size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream in(stat.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return double(utime + stime) / double(::sysconf(_SC_CLK_TCK));
}

std::size_t lines(const std::string& s) {
  return static_cast<std::size_t>(std::count(s.begin(), s.end(), '\n'));
}

}  // namespace

// Item 1 of the hardening issue: the socket path.

TEST_F(HostileDaemon, RefusesAFileThatIsNotASocket) {
  std::ofstream(socket_) << "precious\n";
  start({"--socket", socket_});
  auto rc = exit_of(0);
  ASSERT_TRUE(rc) << "the daemon ran on a regular file's path";
  EXPECT_NE(*rc, 0);
  EXPECT_EQ(slurp(socket_), "precious\n");  // neither removed nor replaced
  std::string err = log(0);
  EXPECT_EQ(lines(err), 1u) << err;
  EXPECT_NE(err.find(socket_), std::string::npos) << err;
  EXPECT_NE(err.find("not a socket"), std::string::npos) << err;
}

TEST_F(HostileDaemon, RefusesALiveSocketAndTheFirstDaemonStaysReachable) {
  Child first = start({"--socket", socket_});
  ASSERT_TRUE(eventually([&] { return pings(socket_); }));
  start({"--socket", socket_});
  auto rc = exit_of(1);
  ASSERT_TRUE(rc) << "a second daemon took over a live socket";
  EXPECT_NE(*rc, 0);
  std::string err = log(1);
  EXPECT_EQ(lines(err), 1u) << err;
  EXPECT_NE(err.find("already running, pid " + std::to_string(first.pid)), std::string::npos)
      << err;
  // The second one's exit removed nothing: the first still answers, on the same name.
  EXPECT_EQ(ping_pid(socket_), std::optional<long>(first.pid));
}

TEST_F(HostileDaemon, ReplacesAStaleSocketNobodyListensOn) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strcpy(a.sun_path, socket_.c_str());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ::close(fd);  // a killed daemon's leftover: bound, nobody listening
  Child d = start({"--socket", socket_});
  EXPECT_TRUE(eventually([&] { return pings(socket_); }));
  EXPECT_EQ(ping_pid(socket_), std::optional<long>(d.pid));
}

TEST_F(HostileDaemon, ARelativeSocketPathIsAnErrorNotAFallback) {
  start({"--socket", "relative.sock"});
  auto rc = exit_of(0);
  ASSERT_TRUE(rc) << "the daemon started anyway (on the default socket)";
  EXPECT_EQ(*rc, 2);
  std::string err = log(0);
  EXPECT_EQ(lines(err), 1u) << err;
  EXPECT_NE(err.find("absolute"), std::string::npos) << err;
}

TEST_F(HostileDaemon, ABadSocketLineInTheFileIsFatalAtStart) {
  std::string conf = dir_ + "/d.conf";
  std::ofstream(conf) << "socket = not/absolute\n";
  start({"--config", conf}, false);
  auto rc = exit_of(0);
  ASSERT_TRUE(rc) << "the daemon started anyway (on the default socket)";
  EXPECT_NE(*rc, 0);
  EXPECT_NE(log(0).find("socket"), std::string::npos);
}

TEST_F(HostileDaemon, ReloadWithABadSocketLineKeepsTheSocket) {
  std::string conf = dir_ + "/d.conf";
  std::ofstream(conf) << "socket = " << socket_ << "\nlog_level = info\n";
  Child d = start({"--config", conf}, false);
  ASSERT_TRUE(eventually([&] { return pings(socket_); }));
  std::string other = dir_ + "/file";
  for (std::string bad : {std::string("relative.sock"), other}) {
    std::ofstream(other) << "not a socket\n";
    std::ofstream(conf) << "socket = " << bad << "\nlog_level = info\n";
    std::size_t reloads = 0;
    for (std::size_t p = 0; (p = log(0).find("configuration reloaded", p)) != std::string::npos;
         ++p)
      ++reloads;
    ::kill(d.pid, SIGHUP);
    ASSERT_TRUE(eventually([&] {
      std::size_t n = 0;
      std::string l = log(0);
      for (std::size_t p = 0; (p = l.find("configuration reloaded", p)) != std::string::npos; ++p)
        ++n;
      return n > reloads;
    })) << log(0);
    EXPECT_EQ(ping_pid(socket_), std::optional<long>(d.pid)) << bad << "\n" << log(0);
    EXPECT_EQ(slurp(other), "not a socket\n");
  }
  // A good new path: the daemon moves there and removes its old name.
  std::string moved = dir_ + "/moved.sock";
  std::ofstream(conf) << "socket = " << moved << "\n";
  ::kill(d.pid, SIGHUP);
  EXPECT_TRUE(eventually([&] { return pings(moved); }));
  EXPECT_TRUE(eventually([&] { return !std::filesystem::exists(socket_); }));
}

TEST_F(HostileDaemon, RefusesLineBreaksInOptions) {
  start({"--socket", socket_ + "\nsocket = " + dir_ + "/other.sock"});
  auto rc = exit_of(0);
  ASSERT_TRUE(rc);
  EXPECT_EQ(*rc, 2);
}

// Item 14: a bad record prefix does not fall back to the production one (whose records the
// daemon would then track and reap).
TEST_F(HostileDaemon, ABadRecordPrefixIsFatalNotAFallback) {
  start({"--socket", socket_, "--set", "record_prefix=../etc"});
  auto rc = exit_of(0);
  ASSERT_TRUE(rc) << "the daemon ran with the default record prefix";
  EXPECT_EQ(*rc, 2);
  EXPECT_NE(log(0).find("record_prefix"), std::string::npos) << log(0);
}

// Item 6: the metrics listener and the daemon's inputs.

TEST_F(HostileDaemon, ATakenMetricsPortIsFatal) {
  int port = free_port();
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(s, 4), 0);
  start({"--socket", socket_, "--prometheus-port", std::to_string(port)});
  auto rc = exit_of(0);
  ::close(s);
  ASSERT_TRUE(rc) << "the daemon ran without the metrics it was asked to serve";
  EXPECT_NE(*rc, 0);
  std::string err = log(0);
  EXPECT_EQ(lines(err), 1u) << err;
  EXPECT_NE(err.find(std::to_string(port)), std::string::npos) << err;
  EXPECT_FALSE(std::filesystem::exists(socket_));  // it did not take its socket either
}

TEST_F(HostileDaemon, AConfigFileThatCannotBeReadIsFatal) {
  std::string fifo = dir_ + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string big = dir_ + "/big.conf";
  std::ofstream(big) << std::string(2 << 20, '#');
  std::size_t i = 0;
  for (const std::string& conf :
       {dir_ + "/missing.conf", dir_, std::string("/dev/zero"), fifo, big}) {
    start({"--socket", socket_, "--config", conf}, false);
    auto rc = exit_of(i, 20s);
    ASSERT_TRUE(rc) << conf << ": the daemon ran (or hung reading it)";
    EXPECT_EQ(*rc, 2) << conf;
    std::string err = log(i);
    EXPECT_EQ(lines(err), 1u) << conf << ": " << err;
    EXPECT_NE(err.find(conf), std::string::npos) << err;
    EXPECT_FALSE(std::filesystem::exists(socket_));
    ++i;
  }
}

TEST_F(HostileDaemon, HeadMetricsAnswersLikeGetWithoutABody) {
  int port = free_port();
  start({"--socket", socket_, "--prometheus-port", std::to_string(port)});
  ASSERT_TRUE(eventually([&] { return pings(socket_); }));
  std::string get = http_get(port, "/metrics");
  ASSERT_NE(get.find("200 OK"), std::string::npos) << get;
  std::string head =
      http(port, "HEAD /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
  EXPECT_NE(head.find("200 OK"), std::string::npos) << head;
  EXPECT_EQ(head.find("# HELP"), std::string::npos) << head;
}

// Idle connections beyond the cap are closed at once: they cannot take every descriptor.
TEST_F(HostileDaemon, MetricsConnectionsAreCapped) {
  int port = free_port();
  Child d = start({"--socket", socket_, "--prometheus-port", std::to_string(port)});
  ASSERT_TRUE(eventually([&] { return pings(socket_); }));
  std::size_t base = open_fds(d.pid);
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) {
    int s = tcp_connect(port);
    if (s >= 0) idle.push_back(s);
  }
  ASSERT_GT(idle.size(), 100u);
  // Give the daemon time to accept them all (the kernel accepts them on its behalf).
  EXPECT_TRUE(eventually([&] { return pings(socket_); }));
  std::this_thread::sleep_for(300ms);
  std::size_t held = open_fds(d.pid) - base;
  EXPECT_LE(held, 40u) << "idle metrics connections held by the daemon";
  EXPECT_TRUE(pings(socket_));
  for (int s : idle) ::close(s);
  // Once the idle ones are gone, metrics are served again.
  EXPECT_TRUE(
      eventually([&] { return http_get(port, "/metrics").find("200 OK") != std::string::npos; }));
}

// At descriptor exhaustion the accept loop must wait, not spin: a failed accept leaves the
// connection queued, and accepting again at once fails again.
TEST_F(HostileDaemon, NoBusyLoopWhenOutOfDescriptors) {
  int port = free_port();
  // Hard and soft limit low enough that a handful of connections exhausts them.
  std::string cmd = "ulimit -n 24 && exec \"$0\" \"$@\"";
  std::vector<std::string> argv{"/bin/sh",
                                "-c",
                                cmd,
                                GPUSTITCHD,
                                "--config",
                                "",
                                "--set",
                                "record_prefix=" + g_.prefix,
                                "--socket",
                                socket_,
                                "--prometheus-port",
                                std::to_string(port)};
  Child d = test::spawn(argv, {}, -1, -1, dir_ + "/stderr.0");
  daemons_.push_back(d);
  logs_.push_back(dir_ + "/stderr.0");
  ASSERT_TRUE(eventually([&] { return pings(socket_); })) << log(0);
  std::vector<int> idle;
  for (int i = 0; i < 60; ++i) {
    int s = tcp_connect(port);
    if (s >= 0) idle.push_back(s);
  }
  std::this_thread::sleep_for(200ms);
  double before = cpu_seconds(d.pid);
  std::this_thread::sleep_for(1500ms);
  double used = cpu_seconds(d.pid) - before;
  for (int s : idle) ::close(s);
  // An idle daemon uses next to nothing; a spinning one a whole core (even on a loaded machine
  // it gets far more than this).
  EXPECT_LT(used, 0.4) << "CPU seconds in 1.5 s with descriptors exhausted";
  EXPECT_TRUE(eventually([&] { return pings(socket_); }));
}

// Item 2: one user cannot deny the socket to others.

namespace {

// A process of uid/gid that keeps up to `count` connections to the socket open, sending nothing
// and reconnecting those the daemon closes, until killed. Its pid; it writes one byte to
// ready_fd once it has tried `count` connections.
pid_t start_flooder(const std::string& socket, int count, int uid, int gid, int ready_fd) {
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) ::_exit(3);
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &lim);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, socket.c_str(), sizeof a.sun_path - 1);
  auto connect_one = [&] {
    int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (s >= 0 && ::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(s);
      s = -1;
    }
    return s;
  };
  std::vector<pollfd> fds;
  for (int i = 0; i < count; ++i)
    if (int s = connect_one(); s >= 0) fds.push_back({s, POLLIN, 0});
  (void)!::write(ready_fd, "r", 1);
  while (true) {
    ::poll(fds.data(), fds.size(), 50);
    for (auto& p : fds) {
      if (!p.revents) continue;
      ::close(p.fd);  // closed by the daemon: open another
      p.fd = connect_one();
      p.revents = 0;
      if (p.fd < 0) p.fd = -1;
    }
    for (auto& p : fds)
      if (p.fd < 0) p.fd = connect_one();
  }
}

}  // namespace

TEST_F(HostileDaemon, RootIsServedWhileAnotherUserFloodsTheSocket) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another user";
  start({"--socket", socket_});
  ASSERT_TRUE(eventually([&] { return pings(socket_); }));
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t flooder = start_flooder(socket_, 300, 65534, 65534, ready[1]);
  ASSERT_GT(flooder, 0);
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);
  int served = 0;
  for (int i = 0; i < 10; ++i) {
    auto j = shm::query_daemon(socket_, {{"cmd", "list"}}, 3000, nullptr);
    if (j && j->value("ok", false)) ++served;
    std::this_thread::sleep_for(100ms);
  }
  ::kill(flooder, SIGKILL);
  ::waitpid(flooder, nullptr, 0);
  EXPECT_EQ(served, 10) << "root's queries answered while nobody held 300 connections";
  EXPECT_NE(log(0).find("connection limit"), std::string::npos) << log(0);
}

TEST_F(HostileDaemon, AnotherUserIsServedWhileOneUserFloods) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run processes as other users";
  start({"--socket", socket_});
  ASSERT_TRUE(eventually([&] { return pings(socket_); }));
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t flooder = start_flooder(socket_, 300, 65534, 65534, ready[1]);
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);
  // A query as uid 1 (daemon, on Debian), from a child so the credentials are its own.
  int served = 0;
  for (int i = 0; i < 5; ++i) {
    pid_t q = ::fork();
    if (q == 0) {
      if (::setgid(1) != 0 || ::setuid(1) != 0) ::_exit(3);
      auto j = shm::query_daemon(socket_, {{"cmd", "ping"}}, 3000, nullptr);
      ::_exit(j && j->value("ok", false) ? 0 : 1);
    }
    int status = 0;
    ::waitpid(q, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) ++served;
  }
  ::kill(flooder, SIGKILL);
  ::waitpid(flooder, nullptr, 0);
  EXPECT_EQ(served, 5);
}

// A connection that sends nothing is closed soon, not held for the whole session time.
TEST_F(HostileDaemon, AnIdleConnectionIsClosedBeforeItsFirstRequest) {
  start({"--socket", socket_});
  ASSERT_TRUE(eventually([&] { return pings(socket_); }));
  int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, socket_.c_str(), sizeof a.sun_path - 1);
  ASSERT_EQ(::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  auto t0 = std::chrono::steady_clock::now();
  pollfd p{s, POLLIN, 0};
  // Generous on a loaded machine, yet below the 5 s a session may take in all.
  ASSERT_EQ(::poll(&p, 1, 4000), 1) << "an idle connection was held for 4 s";
  char buf[16];
  EXPECT_EQ(::read(s, buf, sizeof buf), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s);
  ::close(s);
}

// Item 7: the CLI against a daemon that answers nonsense, and input that is not UTF-8. Whatever
// it meets, it ends with a status and a message, never a signal.

namespace {

// A stand-in for gpustitchd on a socket: answers every connection with `answer` (read the
// request line first), until destroyed.
class FakeDaemon {
 public:
  FakeDaemon(const std::string& path, std::string answer) : answer_(std::move(answer)) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
    ::unlink(path.c_str());
    ok_ = ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(fd_, 16) == 0;
    thread_ = std::thread([this] {
      while (true) {
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, 50) <= 0) {
          if (stop_) return;
          continue;
        }
        int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) continue;
        char buf[4096];
        pollfd q{c, POLLIN, 0};
        if (::poll(&q, 1, 2000) > 0) (void)!::read(c, buf, sizeof buf);
        std::size_t sent = 0;
        while (sent < answer_.size()) {
          ssize_t n = ::send(c, answer_.data() + sent, answer_.size() - sent, MSG_NOSIGNAL);
          if (n <= 0) break;
          sent += static_cast<std::size_t>(n);
        }
        ::close(c);
      }
    });
  }
  ~FakeDaemon() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
  }
  bool ok() const { return ok_; }

 private:
  std::string answer_;
  int fd_ = -1;
  bool ok_ = false;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Runs the CLI with its stderr in a file; {status (128 + signal when killed), stdout, stderr}.
struct CliResult {
  int rc;
  std::string out, err;
};
CliResult cli(const std::string& dir, std::vector<std::string> args) {
  args.insert(args.begin(), GPUSTITCH_CLI);
  std::string err_path = dir + "/cli.err";
  ::unlink(err_path.c_str());
  Child c = test::spawn(args, {}, -1, -1, err_path);
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(c.out, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(c.out);
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out, slurp(err_path)};
}

}  // namespace

TEST_F(HostileDaemon, CliSurvivesAnswersOfTheWrongShape) {
  std::string deep(100000, '[');
  deep += std::string(100000, ']');
  const std::vector<std::string> answers = {
      // Every field of the wrong type.
      R"({"ok":true,"process":{"pid":"x","user":5,"devices":[{"device":"0","hist_allocs":[1,"a",)"
      R"({}],"hist_live":[{}]},7,"s"],"events":[{"device":"zero","kind":5},3],"sites":[{"frames":)"
      R"(3},"x"]},"history":[{"time_ns":[1,"b",3],"allocated":[1,2,{}],"reserved":[null,{},[]],)"
      R"("device":"d"},5]})",
      R"({"ok":true,"process":{"devices":{"a":1},"events":"e","sites":5},"history":{"x":1}})",
      R"({"ok":true,"process":[1,2],"processes":{"a":1}})",
      R"({"ok":true,"processes":[{"pid":-1,"devices":"x","user":5},{"devices":[5,{"device":"q"}]},3]})",
      R"({"ok":"yes","error":7})",
      R"({"ok":true})",
      R"([1,2,3])",
      R"("just a string")",
      R"({"ok":true,"process":)" + deep + "}",
      "{\"ok\":true,\"process\":{\"command\":\"caf\xe9 \xff\xfe\"}}",
      "not json at all",
  };
  const std::vector<std::vector<std::string>> commands = {
      {"show", "123", "--socket", socket_},
      {"show", "123", "--json", "--socket", socket_},
      {"ps", "--socket", socket_},
      {"ps", "--json", "--socket", socket_},
      {"top", "-n", "1", "--socket", socket_},
      {"top", "-n", "1", "--json", "--socket", socket_},
  };
  for (std::size_t i = 0; i < answers.size(); ++i) {
    FakeDaemon fake(socket_, answers[i] + "\n");
    ASSERT_TRUE(fake.ok());
    for (const auto& cmd : commands) {
      CliResult r = cli(dir_, cmd);
      std::string what = "answer " + std::to_string(i) + ", " + cmd[0] + " " + cmd[1];
      EXPECT_LT(r.rc, 5) << what << ": status " << r.rc << "\n" << r.err;
      if (r.rc != 0) {
        EXPECT_LE(lines(r.err), 1u) << what << ": " << r.err;
      }
    }
  }
}

TEST_F(HostileDaemon, CliJsonOutputSurvivesInputThatIsNotUtf8) {
  const std::string bad = dir_ + "/caf\xe9-\xff.csv";
  for (const auto& cmd : std::vector<std::vector<std::string>>{
           {"replay", "--json", bad},
           {"snapshot", "--json", "1", "-o", dir_ + "/out-\xff", "--timeout-ms", "200"},
       }) {
    CliResult r = cli(dir_, cmd);
    EXPECT_LT(r.rc, 5) << cmd[0] << ": status " << r.rc << "\n" << r.err;
    if (!r.out.empty()) {
      EXPECT_FALSE(json::parse(r.out, nullptr, false).is_discarded()) << r.out;
    }
  }
}

namespace {
// Bytes a terminal acts on: ESC, BEL, the 8-bit CSI as a raw byte and as U+009B (C2 9B), and a
// right-to-left override (U+202E, E2 80 AE).
bool has_terminal_controls(const std::string& s) {
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b == 0x1b || b == 0x07 || b == 0x9b) return true;
    if (b == 0xc2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) >= 0x80 &&
        static_cast<unsigned char>(s[i + 1]) <= 0x9f)
      return true;
    if (s.compare(i, 3, "\xe2\x80\xae") == 0) return true;
  }
  return false;
}
}  // namespace

// Escape sequences from a daemon's answer (a process's command, user, exe, an allocation site,
// the daemon's own error string) never reach the terminal raw: C0, C1 (CSI as 0x9B and as U+009B)
// and bidirectional overrides are replaced in text output, and --json writes U+0080-U+009F as
// \u escapes. Before, a C1 CSI went through everywhere and the error string went through raw.
TEST_F(HostileDaemon, CliNeverPrintsTerminalControlsFromTheDaemon) {
  // (A raw 0x9B byte is not UTF-8 and so cannot be in a JSON answer: see the records test.)
  const std::string evil =
      "ev\x1b]2;owned\x07il \xc2\x9b"
      "31m \xe2\x80\xae"
      "txt caf\xc3\xa9";
  const std::string process =
      R"({"pid":123,"user":")" + evil + R"(","exe":")" + evil + R"(","command":")" + evil +
      R"(","devices":[{"device":0,"uuid":")" + evil +
      R"(","bytes_allocated":1}],"events":[{"kind":")" + evil +
      R"(","device":0}],"sites":[{"live_bytes":1,"count":1,"frames":[{"function":")" + evil +
      R"(","library":")" + evil + R"("}]}]})";
  // JSON strings cannot hold a raw ESC or BEL: the daemon's answer escapes them.
  auto json_escaped = [](std::string s) {
    std::string out;
    for (char c : s) {
      if (c == '\x1b')
        out += "\\u001b";
      else if (c == '\x07')
        out += "\\u0007";
      else
        out += c;
    }
    return out;
  };
  const std::string answers[] = {
      json_escaped(R"({"ok":true,"processes":[)" + process + "]}"),
      json_escaped(R"({"ok":true,"process":)" + process + R"(,"history":[]})"),
      json_escaped(R"({"ok":false,"error":")" + evil + R"("})"),
  };
  const std::vector<std::vector<std::string>> commands = {
      {"show", "123", "--socket", socket_},    {"ps", "--socket", socket_},
      {"top", "-n", "1", "--socket", socket_}, {"show", "123", "--json", "--socket", socket_},
      {"ps", "--json", "--socket", socket_},   {"top", "-n", "1", "--json", "--socket", socket_},
  };
  for (std::size_t i = 0; i < std::size(answers); ++i) {
    FakeDaemon fake(socket_, answers[i] + "\n");
    ASSERT_TRUE(fake.ok());
    for (const auto& cmd : commands) {
      CliResult r = cli(dir_, cmd);
      const std::string what = "answer " + std::to_string(i) + ", " + cmd[0] + " " + cmd[1];
      EXPECT_FALSE(has_terminal_controls(r.out)) << what << ": " << r.out;
      EXPECT_FALSE(has_terminal_controls(r.err)) << what << ": " << r.err;
      const bool as_json = std::find(cmd.begin(), cmd.end(), "--json") != cmd.end();
      const bool shows_it = (i == 0 && cmd[0] != "show") || (i == 1 && cmd[0] == "show");
      if (!as_json && shows_it) {
        EXPECT_NE(r.out.find("caf\xc3\xa9"), std::string::npos) << what << ": letters are kept\n"
                                                                << r.out;
      }
      if (as_json && !r.out.empty()) {
        json j = json::parse(r.out, nullptr, false);  // still the same document for a parser
        ASSERT_FALSE(j.is_discarded()) << what << ": " << r.out;
        if (shows_it) {
          const json& command =
              cmd[0] == "show" ? j["process"]["command"] : j["processes"][0]["command"];
          EXPECT_EQ(command, evil) << what;
        }
      }
    }
  }
}
