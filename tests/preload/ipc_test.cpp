// CUDA IPC on pool memory between two preloaded processes (preload/src/ipc_export.cpp): this test
// is the exporter (ctest preloads it, on the simulated backend and on the fake driver's VMM) and
// drives an importer, ipc_peer, over its stdin/stdout.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda_decls.h"
#include "ipc_protocol.h"
#include "shim_api.h"
#include "subprocess.h"

extern char** environ;

namespace {

constexpr int kSuccess = 0, kInvalidValue = 1;
constexpr std::size_t MiB = 1 << 20;

// The importing process: ipc_peer with this process's environment (LD_PRELOAD included unless
// without_shim), optionally as another user.
class Peer {
 public:
  explicit Peer(bool without_shim = false, uid_t as_uid = 0) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return;
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (without_shim && std::strncmp(*e, "LD_PRELOAD=", 11) == 0) {
        // Only the shim goes: a sanitizer build's runtime must stay first.
        std::string kept = "LD_PRELOAD=", entry;
        for (const char* c = *e + 11;; ++c) {
          if (*c == ':' || *c == ' ' || *c == '\0') {
            if (!entry.empty() && entry.find("libgpustitch") == std::string::npos) {
              kept += (kept.size() > 11 ? ":" : "") + entry;
            }
            entry.clear();
            if (*c == '\0') break;
          } else {
            entry += *c;
          }
        }
        env.push_back(kept);
        continue;
      }
      env.emplace_back(*e);
    }
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    // Through the emulator when this test runs under one (a cross build): it cannot exec a
    // foreign binary itself.
    std::vector<std::string> args = subprocess::emulated({PEER_PATH});
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      close(in[1]);
      close(out[0]);
      if (as_uid != 0 && (setgid(as_uid) != 0 || setuid(as_uid) != 0)) _exit(126);
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    to_ = fdopen(in[1], "w");
    from_ = fdopen(out[0], "r");
  }
  ~Peer() {
    if (to_ != nullptr) {
      std::fputs("exit\n", to_);
      std::fclose(to_);
    }
    if (from_ != nullptr) std::fclose(from_);
    if (pid_ > 0) {
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }
  // One command, one answer line ("" when the peer is gone).
  std::string ask(const std::string& cmd) {
    if (to_ == nullptr || from_ == nullptr) return "";
    std::fprintf(to_, "%s\n", cmd.c_str());
    std::fflush(to_);
    char buf[256];
    if (std::fgets(buf, sizeof buf, from_) == nullptr) return "";
    std::string s(buf);
    if (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  int open(const unsigned char* handle, bool driver = false) {
    std::string hex;
    char b[3];
    for (int i = 0; i < 64; ++i) {
      std::snprintf(b, sizeof b, "%02x", handle[i]);
      hex += b;
    }
    std::string answer = ask("open " + hex + (driver ? " driver" : ""));
    return answer.empty() ? -1 : std::atoi(answer.c_str());
  }
  bool check(int byte, std::size_t len) {
    return ask("check " + std::to_string(byte) + " " + std::to_string(len)) == "1";
  }
  void fill(int byte, std::size_t len) {
    ask("fill " + std::to_string(byte) + " " + std::to_string(len));
  }
  int close_handle(bool driver = false) {
    std::string answer = ask(driver ? "close driver" : "close");
    return answer.empty() ? -1 : std::atoi(answer.c_str());
  }
  // The peer's exit status once it ended (after exit or a failed exec).
  int wait_exit() {
    if (to_ != nullptr) {
      std::fputs("exit\n", to_);
      std::fclose(to_);
      to_ = nullptr;
    }
    int status = 0;
    if (pid_ > 0 && waitpid(pid_, &status, 0) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

bool all(const void* p, int byte, std::size_t len) {
  auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < len; ++i) {
    if (b[i] != byte) return false;
  }
  return true;
}

// Waits (up to 5 s) until the pool's allocated bytes on device 0 drop to at most `bytes`.
bool allocated_drops_to(std::uint64_t bytes) {
  for (int i = 0; i < 500; ++i) {
    if (shim::stats(0).bytes_allocated <= bytes) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// Every test's start: the shim preloaded, device 0 current.
void start_on_device_0() {
  ASSERT_TRUE(shim::preloaded()) << "run under LD_PRELOAD=libgpustitch.so (ctest does)";
  ASSERT_EQ(cudaSetDevice(0), kSuccess);
}

// A pool block this process allocated and exported: what the importer is handed.
struct Exported {
  void* p = nullptr;
  unsigned char handle[64] = {};
};

// cudaMalloc of size, filled with byte (none when negative), and its handle from
// cudaIpcGetMemHandle, or cuIpcGetMemHandle with driver. Asserts: call under
// ASSERT_NO_FATAL_FAILURE.
void export_new_block(std::size_t size, int byte, Exported* e, bool driver = false) {
  ASSERT_EQ(cudaMalloc(&e->p, size), kSuccess);
  if (byte >= 0) std::memset(e->p, byte, size);
  if (driver) {
    ASSERT_EQ(cuIpcGetMemHandle(e->handle, reinterpret_cast<CUdeviceptr>(e->p)), kSuccess);
  } else {
    ASSERT_EQ(cudaIpcGetMemHandle(e->handle, e->p), kSuccess);
  }
}

class Ipc : public ::testing::TestWithParam<std::size_t> {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(start_on_device_0()); }
};

class IpcHandles : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(start_on_device_0()); }
};

// A large block and a slot of the small-object pool (its chunk is exported, with the offset).
INSTANTIATE_TEST_SUITE_P(Sizes, Ipc, ::testing::Values(std::size_t{6} * MiB, std::size_t{4096}),
                         [](const auto& info) { return info.param > MiB ? "Large" : "Small"; });

TEST_P(Ipc, BytesWrittenByEitherProcessAreReadByTheOther) {
  const std::size_t size = GetParam();
  Exported b;
  ASSERT_NO_FATAL_FAILURE(export_new_block(size, 0x5a, &b));
  ASSERT_TRUE(shim::owns(b.p));
  Peer peer;
  ASSERT_EQ(peer.open(b.handle), kSuccess);
  EXPECT_TRUE(peer.check(0x5a, size));
  peer.fill(0xa5, size);
  EXPECT_TRUE(all(b.p, 0xa5, size));
  EXPECT_EQ(peer.close_handle(), kSuccess);
  EXPECT_EQ(cudaFree(b.p), kSuccess);
}

TEST_P(Ipc, DriverApiOpensAndClosesToo) {
  const std::size_t size = GetParam();
  Exported b;
  ASSERT_NO_FATAL_FAILURE(export_new_block(size, 0x33, &b, /*driver=*/true));
  Peer peer;
  ASSERT_EQ(peer.open(b.handle, true), kSuccess);
  EXPECT_TRUE(peer.check(0x33, size));
  EXPECT_EQ(peer.close_handle(true), kSuccess);
  EXPECT_EQ(cudaFree(b.p), kSuccess);
}

TEST_P(Ipc, ExporterFreesFirstAndTheMemoryWaitsForTheLastClose) {
  const std::size_t size = GetParam();
  const std::uint64_t before = shim::stats(0).bytes_allocated;
  Exported b;
  ASSERT_NO_FATAL_FAILURE(export_new_block(size, 0x77, &b));
  Peer peer;
  ASSERT_EQ(peer.open(b.handle), kSuccess);
  const std::uint64_t held = shim::stats(0).bytes_allocated;
  EXPECT_EQ(cudaFree(b.p), kSuccess);
  EXPECT_FALSE(shim::owns(b.p));  // freed, as far as the program can tell
  // Not reused: new allocations of the same size land elsewhere, and the importer's view keeps
  // its bytes while this process writes its new blocks.
  std::vector<void*> more(8);
  for (void*& q : more) {
    ASSERT_EQ(cudaMalloc(&q, size), kSuccess);
    EXPECT_NE(q, b.p);
    std::memset(q, 0x11, size);
  }
  EXPECT_TRUE(peer.check(0x77, size));
  for (void* q : more) EXPECT_EQ(cudaFree(q), kSuccess);
  EXPECT_EQ(shim::stats(0).bytes_allocated, held);  // still held for the importer
  // The block is no longer exportable or freeable here.
  unsigned char again[64];
  EXPECT_NE(cudaIpcGetMemHandle(again, b.p), kSuccess);
  // A second process opening the withdrawn handle is refused.
  {
    Peer late;
    EXPECT_EQ(late.open(b.handle), kInvalidValue);
  }
  EXPECT_EQ(peer.close_handle(), kSuccess);
  EXPECT_TRUE(allocated_drops_to(before)) << shim::stats(0).bytes_allocated;
}

TEST_P(Ipc, ImporterDeathEndsItsLease) {
  const std::size_t size = GetParam();
  const std::uint64_t before = shim::stats(0).bytes_allocated;
  Exported b;
  ASSERT_NO_FATAL_FAILURE(export_new_block(size, -1, &b));
  {
    Peer peer;
    ASSERT_EQ(peer.open(b.handle), kSuccess);
    EXPECT_EQ(cudaFree(b.p), kSuccess);
  }  // exits without closing
  EXPECT_TRUE(allocated_drops_to(before)) << shim::stats(0).bytes_allocated;
}

TEST_F(IpcHandles, OpeningTwiceCountsAndClosingTooOftenIsAnError) {
  Exported b;
  ASSERT_NO_FATAL_FAILURE(export_new_block(2 * MiB, -1, &b));
  Peer peer;
  ASSERT_EQ(peer.open(b.handle), kSuccess);
  std::string first = peer.ask("check 0 0");
  ASSERT_EQ(peer.open(b.handle), kSuccess);  // the same address, one more open
  EXPECT_EQ(peer.close_handle(), kSuccess);
  EXPECT_EQ(peer.close_handle(), kSuccess);
  EXPECT_EQ(peer.close_handle(), kInvalidValue);  // closed already: the driver's answer
  EXPECT_EQ(peer.close_handle(true), kInvalidValue);
  EXPECT_EQ(cudaFree(b.p), kSuccess);
}

TEST_F(IpcHandles, ForgedHandlesAreRejectedWithTheNativeError) {
  Exported b;
  ASSERT_NO_FATAL_FAILURE(export_new_block(2 * MiB, -1, &b));
  namespace ipc = gpustitch::preload::ipc;
  ipc::Handle good;
  std::memcpy(&good, b.handle, sizeof good);
  Peer peer;
  ipc::Handle h = good;
  h.token[3] ^= 1;  // wrong token
  EXPECT_EQ(peer.open(reinterpret_cast<unsigned char*>(&h)), kInvalidValue);
  h = good;
  h.export_id += 1000;  // an export that does not exist
  EXPECT_EQ(peer.open(reinterpret_cast<unsigned char*>(&h)), kInvalidValue);
  h = good;
  h.pid = 0x3ffffff0;  // no such process
  EXPECT_EQ(peer.open(reinterpret_cast<unsigned char*>(&h)), kInvalidValue);
  h = good;
  h.magic ^= 1;  // not ours: the driver's own handle, which it does not know
  EXPECT_EQ(peer.open(reinterpret_cast<unsigned char*>(&h)), kInvalidValue);
  // The real handle still works after all that.
  EXPECT_EQ(peer.open(b.handle), kSuccess);
  EXPECT_EQ(peer.close_handle(), kSuccess);
  EXPECT_EQ(cudaFree(b.p), kSuccess);
}

TEST_F(IpcHandles, AnImporterWithoutGpustitchGetsTheDriversError) {
  Exported b;
  ASSERT_NO_FATAL_FAILURE(export_new_block(2 * MiB, -1, &b));
  Peer peer(/*without_shim=*/true);
  EXPECT_EQ(peer.open(b.handle), kInvalidValue);
  EXPECT_EQ(cudaFree(b.p), kSuccess);
}

TEST_F(IpcHandles, AProcessOfAnotherUserIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to start a process of another user";
  Exported b;
  ASSERT_NO_FATAL_FAILURE(export_new_block(2 * MiB, -1, &b));
  Peer peer(false, /*as_uid=*/65534);
  const int rc = peer.open(b.handle);
  if (rc == -1) {
    const int status = peer.wait_exit();
    EXPECT_EQ(cudaFree(b.p), kSuccess);
    GTEST_SKIP() << "user 65534 cannot run the peer here (exit status " << status << ")";
  }
  EXPECT_EQ(rc, kInvalidValue);
  EXPECT_EQ(cudaFree(b.p), kSuccess);
}

// fork() while exporting: the child has no server and forgets the parent's exports; closing its
// copies of the sockets ends none of the parent's leases, and the parent keeps serving.
TEST_F(IpcHandles, AForkedChildLeavesTheParentsExportsAndLeasesAlone) {
  const std::uint64_t before = shim::stats(0).bytes_allocated;
  Exported first;
  ASSERT_NO_FATAL_FAILURE(export_new_block(2 * MiB, 0x66, &first));
  Peer peer;
  ASSERT_EQ(peer.open(first.handle), kSuccess);
  EXPECT_EQ(cudaFree(first.p), kSuccess);  // deferred: the peer maps it
  pid_t child = fork();
  if (child == 0) {
    // Nobody listens in the child under its own name.
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const int n =
        gpustitch::preload::ipc::socket_name(addr.sun_path + 1, sizeof addr.sun_path - 1,
                                             static_cast<std::uint32_t>(getpid()), getuid());
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    const bool refused =
        connect(fd, reinterpret_cast<sockaddr*>(&addr),
                static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n)) != 0;
    _exit(refused ? 0 : 1);
  }
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_GT(shim::stats(0).bytes_allocated, before);  // the lease still holds the block
  EXPECT_TRUE(peer.check(0x66, 2 * MiB));
  Exported second;
  ASSERT_NO_FATAL_FAILURE(export_new_block(2 * MiB, 0x67, &second));
  {
    Peer other;
    ASSERT_EQ(other.open(second.handle), kSuccess);  // the server still runs
    EXPECT_TRUE(other.check(0x67, 2 * MiB));
    EXPECT_EQ(other.close_handle(), kSuccess);
  }
  EXPECT_EQ(cudaFree(second.p), kSuccess);
  EXPECT_EQ(peer.close_handle(), kSuccess);
  EXPECT_TRUE(allocated_drops_to(before)) << shim::stats(0).bytes_allocated;
}

TEST_F(IpcHandles, CredentialCheckAdmitsTheSameUserAndRootOnly) {
  namespace ipc = gpustitch::preload::ipc;
  EXPECT_TRUE(ipc::peer_allowed(1000, 1000));
  EXPECT_TRUE(ipc::peer_allowed(1000, 0));
  EXPECT_FALSE(ipc::peer_allowed(1000, 1001));
  EXPECT_FALSE(ipc::peer_allowed(0, 1000));
  EXPECT_TRUE(ipc::peer_allowed(0, 0));
}

}  // namespace
