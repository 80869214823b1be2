// The CLI under input it cannot use: numbers out of range (NaN, infinities, negative or huge
// counts), files that are not files (/dev/zero, a FIFO) or are too large, a chart that cannot be
// written, unknown configuration keys. Each is refused before any work with one line naming what
// is wrong and exit status 2 (usage), or 1 where the work ran and failed; never a hang, a busy
// loop or a success.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include "temp_file.h"

#include <chrono>
#include <fstream>
#include <string>
#include <vector>

namespace {

struct CliRun {
  int rc = -1;  // exit status; 128 + signal when killed (the deadline: SIGKILL)
  std::string out, err;
  double seconds = 0;
};

std::string tmp(const std::string& name) {
  return gpustitch::test::temp_file("input", name);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs the CLI with args, killed after deadline_s; optional RLIMIT_FSIZE in bytes.
CliRun cli(std::vector<std::string> args, unsigned deadline_s = 20, long fsize_limit = -1) {
  static int n = 0;
  const std::string out_path = tmp("out" + std::to_string(n)),
                    err_path = tmp("err" + std::to_string(n++));
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = fork();
  if (pid == 0) {
    int o = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int e = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(o, 1);
    dup2(e, 2);
    if (fsize_limit >= 0) {
      signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead
      rlimit lim{static_cast<rlim_t>(fsize_limit), static_cast<rlim_t>(fsize_limit)};
      setrlimit(RLIMIT_FSIZE, &lim);
    }
    args.insert(args.begin(), GPUSTITCH_CLI);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  CliRun r;
  int status = 0;
  for (unsigned waited_ms = 0; waitpid(pid, &status, WNOHANG) == 0; waited_ms += 10) {
    if (waited_ms >= deadline_s * 1000) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    usleep(10000);
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out_path);
  r.err = slurp(err_path);
  unlink(out_path.c_str());
  unlink(err_path.c_str());
  return r;
}

std::string small_trace() {
  const std::string path = tmp("small.csv");
  std::ofstream(path) << "Thread,Time,Action,Pointer,Size,Stream\n"
                         "1,00:00:00.100000,allocate,0x1000,8388608,0x0\n"
                         "1,00:00:00.200000,allocate,0x2000000,4194304,0x0\n"
                         "1,00:00:00.300000,free,0x1000,8388608,0x0\n";
  return path;
}

int lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

}  // namespace

TEST(CliInput, NumbersACommandCannotUseAreUsageErrors) {
  const std::string trace = small_trace();
  const std::vector<std::vector<std::string>> cases = {
      {"replay", trace, "--capacity-gb", "-1"},
      {"replay", trace, "--capacity-gb", "nan"},
      {"replay", trace, "--capacity-gb", "inf"},
      {"replay", trace, "--capacity-gb", "1e30"},
      {"replay", trace, "--max-split-mb", "nan"},
      {"replay", "--generate", tmp("g.csv"), "--steps", "-5"},
      {"replay", "--generate", tmp("g.csv"), "--steps", "0"},
      {"replay", "--generate", tmp("g.csv"), "--steps", "2147483647"},
      {"tune", trace, "--capacity-gb", "nan"},
      {"tune", trace, "--capacity-gb", "1e30"},
      {"tune", trace, "--precision-mb", "inf"},
      {"demo", "--backend", "sim", "--batch", "-3"},
      {"demo", "--backend", "sim", "--steps", "-1"},
      {"demo", "--backend", "sim", "--capacity-gb", "inf"},
      {"top", "--direct", "-n", "2", "-d", "nan"},
      {"top", "--direct", "-n", "2", "-d", "inf"},
      {"show", "1", "--direct", "--history", "604801"},
      {"show", "notapid", "--direct"},
      {"snapshot", "notapid", "-o", tmp("x.pickle")},
  };
  for (const auto& c : cases) {
    std::string what;
    for (const auto& a : c) what += a + " ";
    CliRun r = cli(c, 20);
    EXPECT_EQ(r.rc, 2) << what << "\n" << r.err;
    EXPECT_LT(r.seconds, 10) << what;
    EXPECT_LE(r.err.size(), 400u) << what << ": a short message\n" << r.err;
  }
  // CLI::PositiveNumber's message for a PID printed the range of a double, 300 digits long.
  CliRun r = cli({"show", "notapid", "--direct"});
  EXPECT_NE(r.err.find("not a process id"), std::string::npos) << r.err;
}

// `gpustitch replay /dev/zero` reached 4 GB of memory in 10 s; a FIFO with no writer blocked.
TEST(CliInput, FilesThatAreNotRegularFilesAreRefused) {
  const std::string fifo = tmp("fifo");
  unlink(fifo.c_str());
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {std::string("/dev/zero"), fifo, testing::TempDir()}) {
    for (const char* cmd : {"replay", "tune"}) {
      CliRun r = cli({cmd, path}, 20);
      EXPECT_EQ(r.rc, 2) << cmd << " " << path << "\n" << r.err;
      EXPECT_NE(r.err.find("not a regular file"), std::string::npos) << cmd << ": " << r.err;
      EXPECT_EQ(lines(r.err), 1) << r.err;
    }
    CliRun r = cli({"snapshot", "--trace", path, "-o", tmp("s.pickle")}, 20);
    EXPECT_EQ(r.rc, 2) << "snapshot --trace " << path << "\n" << r.err;
  }
  unlink(fifo.c_str());
}

TEST(CliInput, ATraceLargerThanTheLimitIsRefusedUnread) {
  const std::string big = tmp("sparse.csv");
  {
    int fd = open(big.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, (5ll << 30)), 0);  // sparse: 5 GiB of zeros, no disk used
    close(fd);
  }
  CliRun r = cli({"replay", big}, 20);
  unlink(big.c_str());
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("larger than 4 GiB"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 5) << "refused before reading";
}

// A chart whose write fails (here at the file-size limit) fails the command with the file and the
// reason (before, the reason was left out; an error that only close() reports was ignored).
TEST(CliInput, AChartThatCannotBeWrittenFailsTheCommand) {
  const std::string trace = small_trace(), svg = tmp("chart.svg");
  CliRun ok = cli({"replay", trace, "--policy", "pytorch", "--plot", svg});
  ASSERT_EQ(ok.rc, 0) << ok.err;
  struct stat st;
  ASSERT_EQ(stat(svg.c_str(), &st), 0);
  ASSERT_GT(st.st_size, 2048);
  CliRun r = cli({"replay", trace, "--policy", "pytorch", "--plot", svg}, 20, 1024);
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("cannot write " + svg + ": File too large"), std::string::npos) << r.err;
}

// An unknown --conf key used to start the job with the setting left out.
TEST(CliInput, RunChecksConfBeforeStartingTheProgram) {
  const std::string marker = tmp("started");
  unlink(marker.c_str());
  CliRun r = cli({"run", "--conf", "max_split_size:64", "--", "/bin/sh", "-c", "touch " + marker});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("did you mean max_split_size_mb?"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("GPUSTITCH_CONF: GPUSTITCH_CONF"), std::string::npos) << r.err;
  struct stat st;
  EXPECT_NE(stat(marker.c_str(), &st), 0) << "the program must not have started";
  CliRun bad_value = cli({"run", "--conf", "segment_mb:banana", "--", "/bin/true"});
  EXPECT_EQ(bad_value.rc, 2) << bad_value.err;
}
