// gpustitchd as a process, against what careless or hostile local users do to it: files planted at
// its socket path, a second instance, bad paths on the command line and on reload. Every daemon
// here uses a socket in a fresh temporary directory and a record prefix of its own, so it never
// touches the records or the socket of a real daemon on the machine.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

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
