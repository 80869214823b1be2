// TraceWriter: every event recorded in RMM's CSV columns, from many threads; nothing lost on
// SIGTERM (and the program's own SIGTERM handler still runs); disk problems reported once and
// never fatal; a FIFO or device never blocks the program; forked children do not write into the
// parent's trace.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include "temp_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpustitch/trace/trace_reader.h"
#include "gpustitch/trace/trace_writer.h"

using namespace gpustitch;
using namespace gpustitch::trace;

namespace {

std::string temp_path(const std::string& name) {
  return gpustitch::test::temp_file("trace", name);
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  std::string l;
  while (std::getline(in, l)) out.push_back(l);
  return out;
}

std::vector<std::string> fields_of(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  std::string f;
  while (std::getline(ss, f, ',')) out.push_back(f);
  if (!line.empty() && line.back() == ',') out.push_back("");
  return out;
}

int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1))
    ++n;
  return n;
}

// Redirects stderr to a file for the lifetime of the object.
class StderrCapture {
 public:
  StderrCapture() : path_(temp_path("stderr")) {
    fflush(stderr);
    saved_ = dup(2);
    int fd = open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    close(fd);
  }
  ~StderrCapture() { restore(); }
  std::string text() {
    restore();
    std::ifstream in(path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  void restore() {
    if (saved_ >= 0) {
      fflush(stderr);
      dup2(saved_, 2);
      close(saved_);
      saved_ = -1;
    }
  }
  std::string path_;
  int saved_ = -1;
};

TraceWriterOptions options_for(const std::string& path) {
  TraceWriterOptions o;
  o.path = path;
  o.handle_sigterm = false;
  o.flush_at_exit = false;
  return o;
}

}  // namespace

TEST(TraceWriter, RecordsEveryEventFromManyThreadsThroughASmallRing) {
  const std::string path = temp_path("threads.csv");
  constexpr int kThreads = 4, kPerThread = 20000;
  {
    auto o = options_for(path);
    o.ring_records = 1024;  // far fewer than the events: producers must drain a full ring
    TraceWriter w(o);
    ASSERT_TRUE(w.ok());
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&w, t] {
        for (int i = 0; i < kPerThread; ++i) {
          DevPtr p = (static_cast<DevPtr>(t + 1) << 40) + static_cast<DevPtr>(i) * 4096;
          w.on_allocate(t % 2, p, 1000 + i, 7, ServedBy::cache);
          w.on_free(t % 2, p, 1000 + i, 7);
        }
      });
    }
    for (auto& th : threads) th.join();
    w.close();
    EXPECT_EQ(w.records_written(), 2u * kThreads * kPerThread);
    EXPECT_EQ(w.records_dropped(), 0u);
  }
  Trace tr;
  std::string why;
  ASSERT_TRUE(read_trace_file(path, &tr, &why)) << why;
  EXPECT_EQ(tr.bad_lines, 0u);
  ASSERT_EQ(tr.events.size(), 2u * kThreads * kPerThread);
  // Every allocation is followed (later in the file) by its free, per pointer.
  std::map<std::uint64_t, int> live;
  std::map<std::uint64_t, int> per_thread;
  for (const auto& e : tr.events) {
    if (e.action == TraceAction::allocate) {
      EXPECT_EQ(live[e.ptr]++, 0) << "pointer allocated twice without a free";
      EXPECT_EQ(e.served_by, ServedBy::cache);
      ++per_thread[e.thread];
    } else {
      EXPECT_EQ(live[e.ptr]--, 1) << "free before allocate";
    }
    EXPECT_EQ(e.stream, 7u);
    EXPECT_EQ(e.device, static_cast<int>((e.ptr >> 40) - 1) % 2);
  }
  EXPECT_EQ(per_thread.size(), static_cast<std::size_t>(kThreads));
  for (auto& [tid, n] : per_thread) EXPECT_EQ(n, kPerThread);
}

TEST(TraceWriter, ColumnsAreRmmsThenDeviceAndServedBy) {
  const std::string path = temp_path("columns.csv");
  {
    TraceWriter w(options_for(path));
    w.on_allocate(1, 0x7f8a40000000, 1024, kAnyStream, ServedBy::stitched);
    w.on_free(1, 0x7f8a40000000, 1024, 0x5555);
    w.close();
  }
  auto lines = lines_of(path);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "Thread,Time,Action,Pointer,Size,Stream,Device,ServedBy");
  auto a = fields_of(lines[1]);
  auto f = fields_of(lines[2]);
  ASSERT_EQ(a.size(), 8u) << lines[1];
  ASSERT_EQ(f.size(), 8u) << lines[2];
  // What RMM's replay parser does with each column (benchmarks/utilities/log_parser.hpp).
  EXPECT_EQ(std::stoull(a[0]), static_cast<unsigned long long>(syscall(SYS_gettid)));
  EXPECT_TRUE(std::regex_match(a[1], std::regex(R"(\d\d:\d\d:\d\d\.\d{6})"))) << a[1];
  EXPECT_EQ(a[2], "allocate");
  EXPECT_EQ(std::stoll(a[3], nullptr, 16), 0x7f8a40000000ll);
  EXPECT_EQ(a[4], "1024");
  EXPECT_EQ(a[5], "0xffffffffffffffff");
  EXPECT_EQ(a[6], "1");
  EXPECT_EQ(a[7], "stitched");
  EXPECT_EQ(f[2], "free");
  EXPECT_EQ(f[5], "0x5555");
  EXPECT_EQ(f[7], "");
}

TEST(TraceWriter, UnwritablePathIsReportedOnceAndHarmless) {
  StderrCapture cap;
  TraceWriter w(options_for("/nonexistent-gpustitch-dir/t.csv"));
  EXPECT_FALSE(w.ok());
  for (int i = 0; i < 1000; ++i) w.on_allocate(0, 4096 * (i + 1), 10, 0, ServedBy::fresh);
  w.flush();
  w.close();
  std::string err = cap.text();
  EXPECT_EQ(count_of(err, "gpustitch: trace file"), 1) << err;
  EXPECT_NE(err.find("/nonexistent-gpustitch-dir/t.csv: No such file or directory"),
            std::string::npos)
      << err;
}

TEST(TraceWriter, DeviceFileIsRefusedAndHarmless) {
  StderrCapture cap;
  TraceWriter w(options_for("/dev/full"));
  EXPECT_FALSE(w.ok());
  for (int i = 0; i < 5000; ++i) {
    w.on_allocate(0, 4096 * (i + 1), 10, 0, ServedBy::fresh);
    if (i % 100 == 0) w.flush();
  }
  w.close();
  EXPECT_EQ(w.records_written(), 0u);
  std::string err = cap.text();
  EXPECT_EQ(count_of(err, "gpustitch: trace file"), 1) << err;
  EXPECT_NE(err.find("/dev/full: not a regular file"), std::string::npos) << err;
}

namespace {
// Runs body in a child that SIGALRM kills after `seconds`; returns its wait status. A writer
// that blocks the program shows up as a child killed by SIGALRM instead of a hung test.
template <typename Body>
int run_in_child_with_deadline(unsigned seconds, Body body) {
  pid_t pid = fork();
  if (pid == 0) {
    alarm(seconds);
    _exit(body());
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

std::string make_fifo(const std::string& name) {
  std::string path = temp_path(name);
  unlink(path.c_str());
  EXPECT_EQ(mkfifo(path.c_str(), 0600), 0) << strerror(errno);
  return path;
}
}  // namespace

// trace: naming a FIFO nobody reads used to hang the program in its first allocation (the
// writer's open() waited for a reader, under the library's init lock).
TEST(TraceWriter, FifoWithoutAReaderIsRefusedAtOnce) {
  const std::string fifo = make_fifo("noreader.fifo");
  const std::string err_path = temp_path("noreader.err");
  int status = run_in_child_with_deadline(10, [&] {
    int fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    TraceWriter w(options_for(fifo));
    w.on_allocate(0, 0x1000, 1, 0, ServedBy::fresh);
    w.close();
    return w.ok() ? 3 : 0;
  });
  EXPECT_TRUE(WIFEXITED(status)) << "the writer blocked (killed by signal "
                                 << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << ")";
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0);
  std::ifstream ein(err_path);
  std::stringstream err;
  err << ein.rdbuf();
  EXPECT_EQ(count_of(err.str(), "gpustitch: trace file"), 1) << err.str();
  EXPECT_NE(err.str().find(fifo), std::string::npos) << err.str();
  unlink(fifo.c_str());
}

// A FIFO whose reader opened it and then stopped reading used to block every allocating thread
// once the pipe filled.
TEST(TraceWriter, FifoWhoseReaderStopsReadingNeverBlocksTheProgram) {
  const std::string fifo = make_fifo("stalled.fifo");
  int status = run_in_child_with_deadline(20, [&] {
    int reader = open(fifo.c_str(), O_RDONLY | O_NONBLOCK);  // opened, never read
    if (reader < 0) return 4;
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 2);
    auto o = options_for(fifo);
    o.ring_records = 1024;
    TraceWriter w(o);
    for (int i = 0; i < 200000; ++i)
      w.on_allocate(0, 0x10000 + 4096 * static_cast<DevPtr>(i), 64, 0, ServedBy::fresh);
    w.close();
    return w.ok() ? 3 : 0;
  });
  EXPECT_TRUE(WIFEXITED(status)) << "the program blocked (killed by signal "
                                 << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << ")";
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0) << "a FIFO must not be traced";
  unlink(fifo.c_str());
}

TEST(TraceWriter, DiskFullMidwayKeepsEveryWrittenLineWhole) {
  const std::string path = temp_path("fsize.csv");
  const std::string err_path = temp_path("fsize.err");
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    signal(SIGXFSZ, SIG_IGN);  // writes past the limit fail with EFBIG instead of killing us
    rlimit lim{64 * 1024, 64 * 1024};
    setrlimit(RLIMIT_FSIZE, &lim);
    auto o = options_for(path);
    o.start_thread = false;
    TraceWriter w(o);
    for (int i = 0; i < 10000; ++i) {
      w.on_allocate(0, 0x10000 + 4096 * static_cast<DevPtr>(i), i, 0, ServedBy::fresh);
      if (i % 97 == 0) w.flush();
    }
    w.close();
    _exit(w.ok() ? 3 : 0);  // the limit must have been hit, and we are still here
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  std::ifstream ein(err_path);
  std::stringstream err;
  err << ein.rdbuf();
  EXPECT_EQ(count_of(err.str(), "gpustitch: trace file"), 1) << err.str();
  EXPECT_NE(err.str().find("File too large"), std::string::npos) << err.str();
  Trace tr;
  ASSERT_TRUE(read_trace_file(path, &tr, nullptr));
  EXPECT_TRUE(tr.has_header);
  EXPECT_EQ(tr.bad_lines, 0u);
  ASSERT_GT(tr.events.size(), 0u);
  EXPECT_LT(tr.events.size(), 10000u);
  for (std::size_t i = 0; i < tr.events.size(); ++i) EXPECT_EQ(tr.events[i].size, i);
}

namespace {
// Child body for the SIGTERM tests: records events numbered 0.. in the Size column, tells the
// parent through `ready` once `announce` are recorded, and keeps going until `total`.
[[noreturn]] void record_until_killed(const std::string& path, int ready, int announce, int total) {
  TraceWriterOptions o;
  o.path = path;
  o.flush_interval_ms = 60000;  // the writer thread will not flush in time: the handler must
  o.ring_records = 1 << 17;
  TraceWriter* w = new TraceWriter(o);
  for (int i = 0; i < total; ++i) {
    w->on_allocate(0, 0x10000 + 4096 * static_cast<DevPtr>(i), static_cast<std::size_t>(i), 0,
                   ServedBy::fresh);
    if (i + 1 == announce) {
      char c = 'r';
      (void)!write(ready, &c, 1);
    }
  }
  for (;;) pause();
}
}  // namespace

TEST(TraceWriter, SigtermFlushesEverythingThenDiesBySigterm) {
  const std::string path = temp_path("sigterm.csv");
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(fds[0]);
    record_until_killed(path, fds[1], 50000, 60000);
  }
  close(fds[1]);
  char c;
  ASSERT_EQ(read(fds[0], &c, 1), 1);
  kill(pid, SIGTERM);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM)
      << "the default action must still apply after the flush";
  Trace tr;
  ASSERT_TRUE(read_trace_file(path, &tr, nullptr));
  EXPECT_TRUE(tr.has_header);
  EXPECT_EQ(tr.bad_lines, 0u);
  ASSERT_GE(tr.events.size(), 50000u);
  for (std::size_t i = 0; i < tr.events.size(); ++i) ASSERT_EQ(tr.events[i].size, i);
}

namespace {
int g_handler_pipe = -1;
void program_handler(int) {
  char c = 'h';
  (void)!write(g_handler_pipe, &c, 1);
  _exit(7);
}
}  // namespace

TEST(TraceWriter, SigtermChainsToTheProgramsOwnHandler) {
  const std::string path = temp_path("chain.csv");
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(ready[0]);
    g_handler_pipe = ready[1];
    signal(SIGTERM, program_handler);  // installed before gpustitch's
    record_until_killed(path, ready[1], 1000, 1000);
  }
  close(ready[1]);
  char c;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  kill(pid, SIGTERM);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 7) << "the program's handler must run";
  Trace tr;
  ASSERT_TRUE(read_trace_file(path, &tr, nullptr));
  EXPECT_EQ(tr.events.size(), 1000u);
}

TEST(TraceWriter, ForkedChildDoesNotWriteIntoTheParentsTrace) {
  const std::string path = temp_path("fork.csv");
  TraceWriter w(options_for(path));
  w.on_allocate(0, 0x1000, 1, 0, ServedBy::fresh);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    for (int i = 0; i < 100; ++i) w.on_allocate(0, 0x2000 + i, 2, 0, ServedBy::fresh);
    w.flush();
    exit(0);  // runs atexit hooks
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  w.on_free(0, 0x1000, 1, 0);
  w.close();
  Trace tr;
  ASSERT_TRUE(read_trace_file(path, &tr, nullptr));
  ASSERT_EQ(tr.events.size(), 2u);
  EXPECT_EQ(tr.events[0].size, 1u);
  EXPECT_EQ(tr.events[1].action, TraceAction::free);
}

TEST(TraceWriter, MadeOnlyWhenTheConfigurationAsksForIt) {
  Config c;
  EXPECT_EQ(make_trace_writer(c), nullptr);
  auto parsed = parse_config("trace:" + temp_path("conf.csv"));
  ASSERT_TRUE(parsed.errors.empty());
  auto w = make_trace_writer(parsed.config);
  ASSERT_NE(w, nullptr);
  EXPECT_TRUE(w->ok());
  EXPECT_EQ(w->path(), temp_path("conf.csv"));
}

TEST(TraceWriter, NormalExitFlushesEverything) {
  const std::string path = temp_path("exit.csv");
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    TraceWriterOptions o;
    o.path = path;
    o.flush_interval_ms = 60000;   // only the exit hook can write these in time
    auto* w = new TraceWriter(o);  // never destroyed, as in the preload library
    for (int i = 0; i < 30000; ++i)
      w->on_allocate(0, 0x10000 + 4096 * static_cast<DevPtr>(i), static_cast<std::size_t>(i), 0,
                     ServedBy::cache);
    exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  Trace tr;
  ASSERT_TRUE(read_trace_file(path, &tr, nullptr));
  EXPECT_EQ(tr.bad_lines, 0u);
  ASSERT_EQ(tr.events.size(), 30000u);
  EXPECT_EQ(tr.events.back().size, 29999u);
}
