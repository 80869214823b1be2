#include "server.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

// Boost 1.74's Asio uses std::exchange without including <utility> in C++20 mode.
#include <utility>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>

#include <spdlog/spdlog.h>

#include "coop_relay.h"
#include "http.h"
#include "process_table.h"
#include "prometheus.h"
#include "request.h"

namespace gpustitch::daemon {
namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using unix_proto = asio::local::stream_protocol;

void apply_log_level(const std::string& level) {
  spdlog::set_level(spdlog::level::from_str(level));
}

namespace {

// Socket clients at once. Any local user may connect, so one user must not be able to take every
// slot: each unprivileged uid gets kMaxSessionsPerUid, all of them together kMaxSessions, and
// root and admin_group members have kMaxPrivilegedSessions of their own, which nobody else can
// use (so `gpustitch ps` as root works while others flood the socket).
constexpr int kMaxSessions = 256;
constexpr int kMaxSessionsPerUid = 8;
constexpr int kMaxPrivilegedSessions = 32;
// A client has this long to send its request line (the CLI sends it right after connecting);
// an idle connection is closed then, not held for the whole session time.
constexpr auto kFirstRequestTimeout = std::chrono::seconds(1);
// Then this long to take the answer.
constexpr auto kSessionTimeout = std::chrono::seconds(5);
// Metrics clients at once. A scrape takes milliseconds; beyond this a client is closed at once,
// so connections can never take every descriptor the daemon has.
constexpr int kMaxHttpSessions = 32;
// Time to send the request headers, and to take the whole answer.
constexpr auto kHttpReadTimeout = std::chrono::seconds(2);
constexpr auto kHttpWriteTimeout = std::chrono::seconds(10);
// After a failed accept (out of descriptors, mostly): wait this long before accepting again. The
// pending connection stays queued, so accepting again at once fails again: a 100% CPU loop.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

class Server;

class UnixSession : public std::enable_shared_from_this<UnixSession> {
 public:
  UnixSession(Server& server, unix_proto::socket socket, Peer peer, bool privileged);
  ~UnixSession();
  void start();

 private:
  void arm(std::chrono::steady_clock::duration timeout);

  Server& server_;
  unix_proto::socket socket_;
  asio::steady_timer timer_;
  std::string in_;
  std::string out_;
  Peer peer_;
  bool privileged_;
};

class HttpSession : public std::enable_shared_from_this<HttpSession> {
 public:
  HttpSession(Server& server, asio::ip::tcp::socket socket);
  ~HttpSession();
  void start();

 private:
  Server& server_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::empty_body>> parser_;
  http::response<http::string_body> response_;
};

// Whether gpustitchd may bind path: nothing there, or a socket nobody listens on (left by a
// daemon that was killed), which it then removes. Anything else is refused: a file that is not a
// socket is not ours to delete, and a socket that accepts belongs to a running daemon (taking its
// name would leave that daemon unreachable).
bool check_socket_path(const std::string& path, std::string* why) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return true;
    *why = std::strerror(errno);
    return false;
  }
  if (!S_ISSOCK(st.st_mode)) {
    *why = "exists and is not a socket; not removing it";
    return false;
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *why = std::strerror(errno);
    return false;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), std::min(path.size(), sizeof addr.sun_path - 1));
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  int err = errno;
  if (rc == 0 || err == EAGAIN || err == EINPROGRESS) {
    // Listening (EAGAIN: listening with a full backlog). The listener's pid, from the kernel.
    ucred cred{};
    socklen_t len = sizeof cred;
    if (rc == 0 && ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid > 0)
      *why = fmt::format("already running, pid {}", cred.pid);
    else
      *why = "already running (the socket accepts connections)";
    ::close(fd);
    return false;
  }
  ::close(fd);
  if (err != ECONNREFUSED) {
    *why = std::string("cannot probe the existing socket: ") + std::strerror(err);
    return false;
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    *why = std::string("cannot remove the stale socket: ") + std::strerror(errno);
    return false;
  }
  spdlog::info("removed the stale socket {}", path);
  return true;
}

class Server {
 public:
  explicit Server(const ServerOptions& options) : options_(options), table_(DaemonConfig{}) {}

  int run() {
    if (!load_config(true)) return 2;
    table_.reconfigure(config_);
    // Metrics first: a port that cannot be had stops the daemon before it takes its socket.
    if (!open_http()) return 1;
    if (!open_socket(config_.socket_path)) return 1;
    signals_.async_wait([this](auto ec, int sig) { on_signal(ec, sig); });
    sample();
    sd_notify(0, "READY=1");
    spdlog::info("gpustitchd ready: socket {}, sampling every {} ms, history {} s{}",
                 config_.socket_path, config_.sample_interval_ms, config_.history_seconds,
                 config_.prometheus_port
                     ? fmt::format(", metrics on http://{}:{}/metrics", config_.prometheus_address,
                                   config_.prometheus_port)
                     : std::string());
    io_.run();
    sd_notify(0, "STOPPING=1");
    close_socket();
    spdlog::info("gpustitchd stopped");
    return 0;
  }

  const ProcessTable& table() const { return table_; }
  const DaemonConfig& config() const { return config_; }
  CoopRelay& coop() { return coop_; }
  // Socket sessions open: unprivileged (all, and per uid) and privileged.
  void session_opened(uid_t uid, bool privileged) {
    if (privileged) {
      ++privileged_sessions_;
      return;
    }
    ++sessions_;
    ++sessions_by_uid_[uid];
  }
  void session_closed(uid_t uid, bool privileged) {
    if (privileged) {
      --privileged_sessions_;
      return;
    }
    --sessions_;
    if (auto it = sessions_by_uid_.find(uid); it != sessions_by_uid_.end() && --it->second <= 0)
      sessions_by_uid_.erase(it);
  }
  int& http_sessions() { return http_sessions_; }
  asio::io_context& io() { return io_; }

 private:
  // first: at start, where a bad command-line option or a bad `socket` line is fatal (one line,
  // exit 2). On reload a bad `socket` line keeps the current socket.
  bool load_config(bool first) {
    DaemonConfigResult r{DaemonConfig{}, {}, {}, false};
    if (!options_.config_path.empty()) {
      // Only the default file may be absent; one named with -c must be there and readable.
      std::error_code ec;
      if (options_.config_required ||
          std::filesystem::symlink_status(options_.config_path, ec).type() !=
              std::filesystem::file_type::not_found) {
        r = load_daemon_config(options_.config_path);
        if (r.unreadable) {
          if (first) {
            spdlog::error("config: {}", r.errors.front());
            return false;
          }
          spdlog::error("config: {}; keeping the current configuration", r.errors.front());
          return false;
        }
      }
    }
    auto o = parse_daemon_config(options_.override_text, r.config);
    if (first && !o.errors.empty()) {
      spdlog::error("command line: {}", o.errors.front().substr(o.errors.front().find(": ") + 2));
      return false;
    }
    // A bad socket or record prefix never falls back to the default: that would take over the
    // production daemon's socket, or track (and reap) the production records.
    bool bad_socket = r.bad("socket") || o.bad("socket");
    bool bad_prefix = r.bad("record_prefix") || o.bad("record_prefix");
    r.config = o.config;
    for (auto& e : o.errors) r.errors.push_back("command line: " + e);
    if ((bad_socket || bad_prefix) && first) {
      for (const auto& e : r.errors)
        if (e.find(bad_socket ? "socket:" : "record_prefix:") != std::string::npos) {
          spdlog::error("config: {}", e);
          break;
        }
      return false;
    }
    if (bad_socket) r.config.socket_path = config_.socket_path;
    if (bad_prefix) r.config.record_prefix = config_.record_prefix;
    apply_log_level(r.config.log_level);
    for (const auto& e : r.errors) spdlog::warn("config: {}", e);
    if (bad_socket) spdlog::warn("config: keeping the socket {}", config_.socket_path);
    if (bad_prefix) spdlog::warn("config: keeping the record prefix {}", config_.record_prefix);
    config_ = r.config;
    return true;
  }

  // Listens on path, after check_socket_path() judged it free. On failure logs one line and
  // leaves the current listener (if any) alone.
  bool open_socket(const std::string& path) {
    std::string why;
    if (!check_socket_path(path, &why)) {
      spdlog::error("cannot listen on {}: {}", path, why);
      return false;
    }
    try {
      auto acceptor = std::make_unique<unix_proto::acceptor>(io_);
      unix_proto::endpoint ep(path);
      acceptor->open(ep.protocol());
      // No SO_REUSEADDR: bind() fails on an existing name, so a daemon that started between the
      // check and here keeps its socket.
      acceptor->bind(ep);
      struct stat st;
      if (::lstat(path.c_str(), &st) != 0) throw std::runtime_error("socket vanished after bind");
      ::chmod(path.c_str(), config_.socket_mode);
      acceptor->listen();
      close_socket();
      unix_acceptor_ = std::move(acceptor);
      socket_path_ = path;
      socket_dev_ = st.st_dev;
      socket_ino_ = st.st_ino;
      accept_unix();
      return true;
    } catch (const std::exception& e) {
      spdlog::error("cannot listen on {}: {}", path, e.what());
      return false;
    }
  }

  void close_socket() {
    if (unix_acceptor_) {
      boost::system::error_code ec;
      unix_acceptor_->close(ec);
      unix_acceptor_.reset();
      // Remove the name only while it still is our socket: another daemon may own it by now.
      struct stat st;
      if (::lstat(socket_path_.c_str(), &st) == 0 && st.st_dev == socket_dev_ &&
          st.st_ino == socket_ino_)
        ::unlink(socket_path_.c_str());
    }
  }

  // Listens for metrics as configured (nothing when the port is 0). On failure logs one line and
  // keeps the current listener, so a reload to a taken port leaves metrics where they were.
  bool open_http() {
    if (config_.prometheus_port == http_port_ && config_.prometheus_address == http_address_ &&
        (http_acceptor_ || !http_port_))
      return true;
    std::unique_ptr<asio::ip::tcp::acceptor> acceptor;
    if (config_.prometheus_port) {
      try {
        auto addr = asio::ip::make_address(config_.prometheus_address);
        asio::ip::tcp::endpoint ep(addr, static_cast<unsigned short>(config_.prometheus_port));
        acceptor = std::make_unique<asio::ip::tcp::acceptor>(io_);
        acceptor->open(ep.protocol());
        acceptor->set_option(asio::socket_base::reuse_address(true));
        acceptor->bind(ep);
        acceptor->listen();
      } catch (const std::exception& e) {
        spdlog::error("cannot serve metrics on {}:{}: {}", config_.prometheus_address,
                      config_.prometheus_port, e.what());
        return false;
      }
    }
    if (http_acceptor_) {
      boost::system::error_code ec;
      http_acceptor_->close(ec);
    }
    http_acceptor_ = std::move(acceptor);
    http_port_ = config_.prometheus_port;
    http_address_ = config_.prometheus_address;
    if (http_acceptor_) accept_http();
    return true;
  }

  // A new socket client: served if its user (from SO_PEERCRED, which it cannot forge) is within
  // its limits, else closed at once.
  void admit(unix_proto::socket s) {
    ucred cred{};
    socklen_t len = sizeof cred;
    boost::system::error_code ignore;
    if (::getsockopt(s.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      s.close(ignore);
      return;
    }
    Peer peer{cred.uid, cred.gid, cred.pid, {}};
    peer.groups = process_groups(cred.pid);
    bool privileged = peer_sees_all(peer, config_.admin_group);
    const char* refused = nullptr;
    if (privileged) {
      if (privileged_sessions_ >= kMaxPrivilegedSessions) refused = "root and admin_group";
    } else if (sessions_ >= kMaxSessions) {
      refused = "all users";
    } else if (auto it = sessions_by_uid_.find(cred.uid);
               it != sessions_by_uid_.end() && it->second >= kMaxSessionsPerUid) {
      refused = "this user";
    }
    if (refused) {
      auto now = std::chrono::steady_clock::now();
      if (now - last_limit_log_ > std::chrono::minutes(1)) {
        last_limit_log_ = now;
        spdlog::warn(
            "socket: connection limit for {} reached (uid {}, pid {}); closing new connections "
            "(limits: {} per user, {} in all, {} for root and admin_group)",
            refused, cred.uid, cred.pid, kMaxSessionsPerUid, kMaxSessions, kMaxPrivilegedSessions);
      }
      s.close(ignore);
      return;
    }
    std::make_shared<UnixSession>(*this, std::move(s), std::move(peer), privileged)->start();
  }

  // An accept failed for want of resources: say so (once a minute at most) and try again later.
  void accept_failed(const char* what, const boost::system::error_code& ec,
                     std::function<void()> again) {
    auto now = std::chrono::steady_clock::now();
    if (now - last_accept_log_ > std::chrono::minutes(1)) {
      last_accept_log_ = now;
      spdlog::warn("{}: accept failed: {}; retrying every {} ms", what, ec.message(),
                   kAcceptBackoff.count());
    }
    auto timer = std::make_shared<asio::steady_timer>(io_, kAcceptBackoff);
    timer->async_wait([timer, again = std::move(again)](boost::system::error_code e) {
      if (!e) again();
    });
  }

  void accept_unix() {
    auto* acceptor = unix_acceptor_.get();
    acceptor->async_accept([this, acceptor](boost::system::error_code ec, unix_proto::socket s) {
      if (ec == asio::error::operation_aborted || unix_acceptor_.get() != acceptor) return;
      if (ec) {
        accept_failed("socket", ec, [this, acceptor] {
          if (unix_acceptor_.get() == acceptor) accept_unix();
        });
        return;
      }
      admit(std::move(s));
      accept_unix();
    });
  }

  void accept_http() {
    auto* acceptor = http_acceptor_.get();
    acceptor->async_accept([this, acceptor](boost::system::error_code ec, asio::ip::tcp::socket s) {
      if (ec == asio::error::operation_aborted || http_acceptor_.get() != acceptor) return;
      if (ec) {
        accept_failed("metrics", ec, [this, acceptor] {
          if (http_acceptor_.get() == acceptor) accept_http();
        });
        return;
      }
      if (http_sessions_ >= kMaxHttpSessions) {
        boost::system::error_code ignore;
        s.close(ignore);
      } else {
        std::make_shared<HttpSession>(*this, std::move(s))->start();
      }
      accept_http();
    });
  }

  void sample() {
    PassStats s = table_.sample();
    coop_.after_sample(table_, config_);
    spdlog::debug(
        "pass: {} records, {} tracked, {} exited, {} reaped, {} rejected, {} busy, {} examined, "
        "{} over quota, {:.2f} ms cpu",
        s.discovered, s.tracked, s.exited, s.reaped, s.rejected, s.busy, s.examined, s.over_quota,
        double(s.cpu_ns) / 1e6);
    sample_timer_.expires_after(std::chrono::milliseconds(config_.sample_interval_ms));
    sample_timer_.async_wait([this](boost::system::error_code ec) {
      if (!ec) sample();
    });
  }

  void on_signal(boost::system::error_code ec, int sig) {
    if (ec) return;
    if (sig == SIGHUP) {
      sd_notify(0, "RELOADING=1");
      std::string old_socket = config_.socket_path;
      if (load_config(false)) table_.reconfigure(config_);
      if (config_.socket_path != old_socket) {
        // The new socket first: if it cannot be had, the daemon stays reachable where it was.
        if (!open_socket(config_.socket_path)) {
          spdlog::warn("keeping the socket {}", old_socket);
          config_.socket_path = old_socket;
        }
      } else {
        ::chmod(config_.socket_path.c_str(), config_.socket_mode);
      }
      if (!open_http()) {
        config_.prometheus_port = http_port_;
        config_.prometheus_address = http_address_;
      }
      sample_timer_.cancel();
      sample();
      spdlog::info("configuration reloaded");
      sd_notify(0, "READY=1");
      signals_.async_wait([this](auto ec2, int sig2) { on_signal(ec2, sig2); });
      return;
    }
    spdlog::info("signal {}: stopping", sig);
    io_.stop();
  }

  ServerOptions options_;
  // Before io_: sessions that io_ still holds when it is destroyed count themselves out here.
  int sessions_ = 0;
  int privileged_sessions_ = 0;
  std::map<uid_t, int> sessions_by_uid_;
  std::chrono::steady_clock::time_point last_limit_log_{};
  int http_sessions_ = 0;
  DaemonConfig config_;
  ProcessTable table_;
  CoopRelay coop_;
  asio::io_context io_{1};
  asio::signal_set signals_{io_, SIGTERM, SIGINT, SIGHUP};
  asio::steady_timer sample_timer_{io_};
  std::unique_ptr<unix_proto::acceptor> unix_acceptor_;
  std::unique_ptr<asio::ip::tcp::acceptor> http_acceptor_;
  std::string socket_path_;
  dev_t socket_dev_ = 0;
  ino_t socket_ino_ = 0;
  unsigned http_port_ = 0;
  std::string http_address_;
  std::chrono::steady_clock::time_point last_accept_log_{};
};

UnixSession::UnixSession(Server& server, unix_proto::socket socket, Peer peer, bool privileged)
    : server_(server),
      socket_(std::move(socket)),
      timer_(server.io()),
      peer_(std::move(peer)),
      privileged_(privileged) {
  server_.session_opened(peer_.uid, privileged_);
}

UnixSession::~UnixSession() {
  server_.session_closed(peer_.uid, privileged_);
}

void UnixSession::arm(std::chrono::steady_clock::duration timeout) {
  auto self = shared_from_this();
  timer_.expires_after(timeout);
  timer_.async_wait([self](boost::system::error_code ec) {
    if (!ec) {
      boost::system::error_code ignore;
      self->socket_.close(ignore);
    }
  });
}

void UnixSession::start() {
  auto self = shared_from_this();
  arm(kFirstRequestTimeout);
  asio::async_read_until(
      socket_, asio::dynamic_buffer(in_, kMaxRequestBytes + 1), '\n',
      [self](boost::system::error_code ec, std::size_t n) {
        if (ec && ec != asio::error::not_found && ec != asio::error::eof) {
          self->timer_.cancel();
          return;
        }
        std::string_view line(self->in_);
        if (!ec) line = line.substr(0, n - 1);
        if (ec == asio::error::not_found)
          line = std::string_view(self->in_).substr(0, kMaxRequestBytes + 1);
        if (auto coop = self->server_.coop().handle(line, self->peer_, self->server_.table(),
                                                    self->server_.config()))
          self->out_ = std::move(*coop);
        else
          self->out_ =
              handle_request(line, self->peer_, self->server_.table(), self->server_.config());
        self->arm(kSessionTimeout);
        asio::async_write(self->socket_, asio::buffer(self->out_),
                          [self](boost::system::error_code, std::size_t) {
                            boost::system::error_code ignore;
                            self->socket_.shutdown(unix_proto::socket::shutdown_both, ignore);
                            self->socket_.close(ignore);
                            self->timer_.cancel();
                          });
      });
}

HttpSession::HttpSession(Server& server, asio::ip::tcp::socket socket)
    : server_(server), stream_(std::move(socket)) {
  ++server_.http_sessions();
}

HttpSession::~HttpSession() {
  --server_.http_sessions();
}

void HttpSession::start() {
  auto self = shared_from_this();
  parser_.emplace();
  limit_http_parser(*parser_);
  stream_.expires_after(kHttpReadTimeout);
  http::async_read(stream_, buffer_, *parser_, [self](beast::error_code ec, std::size_t) {
    if (ec) return;
    self->response_ = http_respond(self->parser_->get(), self->server_.table());
    self->stream_.expires_after(kHttpWriteTimeout);
    http::async_write(self->stream_, self->response_, [self](beast::error_code, std::size_t) {
      beast::error_code ignore;
      self->stream_.socket().shutdown(asio::ip::tcp::socket::shutdown_send, ignore);
    });
  });
}

}  // namespace

int run_server(const ServerOptions& options) {
  try {
    Server server(options);
    return server.run();
  } catch (const std::exception& e) {
    spdlog::critical("fatal: {}", e.what());
    return 1;
  }
}

}  // namespace gpustitch::daemon
