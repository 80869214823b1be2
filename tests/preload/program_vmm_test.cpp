// Memory a program maps itself with the CUDA VMM API (cuMemCreate, cuMemMap, ...), as XLA,
// PyTorch's expandable segments and NCCL do: under LD_PRELOAD=libgpustitch.so every such call
// reaches the fake driver with its arguments unchanged, whichever way the program found the entry
// point (plain symbol, dlsym, cuGetProcAddress, cudaGetDriverEntryPoint), and what the program
// holds that way shows in its statistics record (program_* fields). The pool's own VMM calls
// (backend:cuda on the fake driver) are never counted.
//
// With the pool on the same driver (backend:cuda), a cuMemCreate the pool's idle handles can answer
// is served from them, and the released handles of the pool's properties go to its cache
// (program_lending.h); where the properties differ, nothing changes.
//
// ctest runs this with the fake runtime and driver (doubles/) and a short publish interval; the
// fake backs VMM memory with host memory, so the test also writes and reads it.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include "cuda_decls.h"
#include "doubles/fake_cuda.h"
#include "gpustitch/shm/names.h"
#include "gpustitch/shm/record_reader.h"
#include "shim_api.h"

extern "C" {
int cuMemCreate(std::uint64_t*, std::size_t, const void*, unsigned long long);
int cuMemRelease(std::uint64_t);
int cuMemRetainAllocationHandle(std::uint64_t*, void*);
int cuMemMap(CUdeviceptr, std::size_t, std::size_t, std::uint64_t, unsigned long long);
int cuMemUnmap(CUdeviceptr, std::size_t);
int cuMemAddressReserve(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr, unsigned long long);
int cuMemAddressFree(CUdeviceptr, std::size_t);
int cuMemSetAccess(CUdeviceptr, std::size_t, const void*, std::size_t);
int cuGetProcAddress_v2(const char*, void**, int, std::uint64_t, int*);
}

namespace {

constexpr int kSuccess = 0;
constexpr std::size_t MiB = 1 << 20;

// The VMM entry points as a program holds them.
struct Vmm {
  int (*create)(std::uint64_t*, std::size_t, const void*, unsigned long long);
  int (*release)(std::uint64_t);
  int (*retain)(std::uint64_t*, void*);
  int (*map)(CUdeviceptr, std::size_t, std::size_t, std::uint64_t, unsigned long long);
  int (*unmap)(CUdeviceptr, std::size_t);
  int (*reserve)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr, unsigned long long);
  int (*free)(CUdeviceptr, std::size_t);
};

Vmm plain_symbols() {
  return {&cuMemCreate,     &cuMemRelease, &cuMemRetainAllocationHandle,
          &cuMemMap,        &cuMemUnmap,   &cuMemAddressReserve,
          &cuMemAddressFree};
}

template <typename Lookup>
Vmm looked_up(Lookup lookup) {
  Vmm v{};
  v.create = reinterpret_cast<decltype(v.create)>(lookup("cuMemCreate"));
  v.release = reinterpret_cast<decltype(v.release)>(lookup("cuMemRelease"));
  v.retain = reinterpret_cast<decltype(v.retain)>(lookup("cuMemRetainAllocationHandle"));
  v.map = reinterpret_cast<decltype(v.map)>(lookup("cuMemMap"));
  v.unmap = reinterpret_cast<decltype(v.unmap)>(lookup("cuMemUnmap"));
  v.reserve = reinterpret_cast<decltype(v.reserve)>(lookup("cuMemAddressReserve"));
  v.free = reinterpret_cast<decltype(v.free)>(lookup("cuMemAddressFree"));
  return v;
}

void* libcuda() {
  static void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  return h;
}

// Every entry point is the shim's (and so counted).
void expect_hooks(const Vmm& v) {
  for (const void* fn :
       {reinterpret_cast<const void*>(v.create), reinterpret_cast<const void*>(v.release),
        reinterpret_cast<const void*>(v.retain), reinterpret_cast<const void*>(v.map),
        reinterpret_cast<const void*>(v.unmap), reinterpret_cast<const void*>(v.reserve),
        reinterpret_cast<const void*>(v.free)}) {
    EXPECT_EQ(shim::library_of(fn), "libgpustitch.so") << shim::symbol_of(fn);
  }
}

// CUmemAllocationProp as cuda.h lays it out (32 bytes): pinned memory on device.
struct Prop {
  int type = 1;           // CU_MEM_ALLOCATION_TYPE_PINNED
  int handle_types = 0;   // none
  int location_type = 1;  // CU_MEM_LOCATION_TYPE_DEVICE
  int location_id = 0;
  void* win32 = nullptr;
  unsigned char flags[8] = {};
};
static_assert(sizeof(Prop) == 32);

void allow_read_write(CUdeviceptr va, std::size_t size, int device) {
  int desc[3] = {1, device, 3};  // {location {DEVICE, device}, READWRITE}
  ASSERT_EQ(cuMemSetAccess(va, size, desc, 1), kSuccess);
}

struct Figures {
  std::uint64_t held = 0, created = 0, handles = 0, mapped = 0;
  bool operator==(const Figures&) const = default;
};
std::ostream& operator<<(std::ostream& os, const Figures& f) {
  return os << "{held " << f.held << ", created " << f.created << ", handles " << f.handles
            << ", mapped " << f.mapped << "}";
}

// This process's counters for device as its statistics record shows them.
std::optional<gpustitch::shm::DeviceCounters> recorded_counters(int device) {
  using namespace gpustitch::shm;
  for (const RecordName& n : discover_records(kDefaultPrefix, ::geteuid())) {
    if (n.pid != ::getpid()) continue;
    ReadError err{};
    auto r = RecordReader::open(n, ::geteuid(), &err);
    SnapshotCopy snap;
    if (!r || r->read_snapshot(&snap) != ReadError::none) return std::nullopt;
    if (device >= static_cast<int>(snap.devices.size())) return std::nullopt;
    return snap.devices[device];
  }
  return std::nullopt;
}

// This process's figures for device as its statistics record shows them.
std::optional<Figures> recorded(int device) {
  const auto d = recorded_counters(device);
  if (!d) return std::nullopt;
  return Figures{d->program_held_bytes, d->program_created_bytes, d->program_handles,
                 d->program_mapped_bytes};
}

// Waits (publish interval 10 ms) until the record shows want; returns what it last showed.
Figures wait_for(int device, const Figures& want) {
  Figures last{~0ull, ~0ull, ~0ull, ~0ull};
  for (int i = 0; i < 300; ++i) {
    if (auto f = recorded(device)) {
      last = *f;
      if (last == want) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return last;
}

std::array<std::uint64_t, 5> last_args(const char* symbol) {
  std::array<std::uint64_t, 5> a{};
  EXPECT_EQ(fakecuda_last_args(symbol, a.data()), 1) << symbol << " never reached the driver";
  return a;
}
std::uint64_t addr(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

// Reserves, creates, maps, writes, reads, releases and unmaps through v, checking at each step
// what the driver received and what the record shows.
void map_write_release(const Vmm& v, int device) {
  ASSERT_EQ(wait_for(device, {}), Figures{})
      << "device " << device << " starts with no program memory";
  CUdeviceptr va = 0;
  ASSERT_EQ(v.reserve(&va, 8 * MiB, 0, 0, 0), kSuccess);
  EXPECT_EQ(last_args("cuMemAddressReserve"),
            (std::array<std::uint64_t, 5>{addr(&va), 8 * MiB, 0, 0, 0}));
  Prop prop;
  prop.location_id = device;
  std::uint64_t h = 0;
  ASSERT_EQ(v.create(&h, 4 * MiB, &prop, 0), kSuccess);
  EXPECT_EQ(last_args("cuMemCreate"),
            (std::array<std::uint64_t, 5>{addr(&h), 4 * MiB, addr(&prop), 0, 0}));
  ASSERT_EQ(v.map(va + 2 * MiB, 4 * MiB, 0, h, 0), kSuccess);
  EXPECT_EQ(last_args("cuMemMap"), (std::array<std::uint64_t, 5>{va + 2 * MiB, 4 * MiB, 0, h, 0}));
  allow_read_write(va + 2 * MiB, 4 * MiB, device);
  auto* bytes = reinterpret_cast<unsigned char*>(va + 2 * MiB);
  std::memset(bytes, 0x5a, 4 * MiB);
  EXPECT_EQ(bytes[0], 0x5a);
  EXPECT_EQ(bytes[4 * MiB - 1], 0x5a);
  EXPECT_EQ(wait_for(device, {4 * MiB, 4 * MiB, 1, 4 * MiB}),
            (Figures{4 * MiB, 4 * MiB, 1, 4 * MiB}));

  // Released while mapped: no handle any more, but the memory lives on (and stays readable).
  ASSERT_EQ(v.release(h), kSuccess);
  EXPECT_EQ(last_args("cuMemRelease")[0], h);
  EXPECT_EQ(bytes[12345], 0x5a);
  EXPECT_EQ(wait_for(device, {4 * MiB, 0, 0, 4 * MiB}), (Figures{4 * MiB, 0, 0, 4 * MiB}));

  ASSERT_EQ(v.unmap(va + 2 * MiB, 4 * MiB), kSuccess);
  EXPECT_EQ(last_args("cuMemUnmap"),
            (std::array<std::uint64_t, 5>{va + 2 * MiB, 4 * MiB, 0, 0, 0}));
  EXPECT_EQ(wait_for(device, {}), Figures{});
  ASSERT_EQ(v.free(va, 8 * MiB), kSuccess);
  EXPECT_EQ(last_args("cuMemAddressFree"), (std::array<std::uint64_t, 5>{va, 8 * MiB, 0, 0, 0}));
}

class ProgramVmm : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(shim::preloaded()) << "run under LD_PRELOAD=libgpustitch.so (ctest does)";
    ASSERT_EQ(cudaSetDevice(0), kSuccess);
    void* p = nullptr;  // starts the pool (and its statistics record)
    ASSERT_EQ(cudaMalloc(&p, 1 * MiB), kSuccess);
    ASSERT_EQ(cudaFree(p), kSuccess);
    bool published = false;  // the publisher thread's first snapshot
    for (int i = 0; i < 300 && !published; ++i) {
      published = recorded(1).has_value();
      if (!published) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(published) << "no statistics record for this process";
  }
};

TEST_F(ProgramVmm, PlainSymbolsAreForwardedAndCounted) {
  expect_hooks(plain_symbols());
  map_write_release(plain_symbols(), 0);
}

TEST_F(ProgramVmm, DlsymOnTheDriverIsForwardedAndCounted) {
  ASSERT_NE(libcuda(), nullptr);
  Vmm v = looked_up([](const char* name) { return dlsym(libcuda(), name); });
  expect_hooks(v);
  map_write_release(v, 1);  // the second device: counted where the properties put the memory
}

TEST_F(ProgramVmm, CuGetProcAddressIsForwardedAndCounted) {
  auto gpa = reinterpret_cast<int (*)(const char*, void**, int, std::uint64_t, int*)>(
      dlsym(libcuda(), "cuGetProcAddress_v2"));
  ASSERT_NE(gpa, nullptr);
  Vmm v = looked_up([gpa](const char* name) {
    void* fn = nullptr;
    int status = -1;
    EXPECT_EQ(gpa(name, &fn, 12000, 0, &status), kSuccess) << name;
    return fn;
  });
  expect_hooks(v);
  map_write_release(v, 0);
  // Asked for a version before VMM existed, the driver has nothing and the caller gets nothing.
  void* fn = reinterpret_cast<void*>(1);
  int status = -1;
  EXPECT_NE(gpa("cuMemCreate", &fn, 10010, 0, &status), kSuccess);
}

TEST_F(ProgramVmm, CudaGetDriverEntryPointIsForwardedAndCounted) {
  Vmm v = looked_up([](const char* name) {
    void* fn = nullptr;
    int status = -1;
    EXPECT_EQ(cudaGetDriverEntryPoint(name, &fn, 0, &status), kSuccess) << name;
    return fn;
  });
  expect_hooks(v);
  map_write_release(v, 0);
}

TEST_F(ProgramVmm, RetainedHandleCountsUntilReleasedAgain) {
  Vmm v = plain_symbols();
  CUdeviceptr va = 0;
  ASSERT_EQ(v.reserve(&va, 2 * MiB, 0, 0, 0), kSuccess);
  Prop prop;
  std::uint64_t h = 0;
  ASSERT_EQ(v.create(&h, 2 * MiB, &prop, 0), kSuccess);
  ASSERT_EQ(v.map(va, 2 * MiB, 0, h, 0), kSuccess);
  ASSERT_EQ(v.release(h), kSuccess);
  EXPECT_EQ(wait_for(0, {2 * MiB, 0, 0, 2 * MiB}), (Figures{2 * MiB, 0, 0, 2 * MiB}));
  std::uint64_t again = 0;
  ASSERT_EQ(v.retain(&again, reinterpret_cast<void*>(va)), kSuccess);
  EXPECT_EQ(again, h);
  EXPECT_EQ(wait_for(0, {2 * MiB, 2 * MiB, 1, 2 * MiB}), (Figures{2 * MiB, 2 * MiB, 1, 2 * MiB}));
  ASSERT_EQ(v.unmap(va, 2 * MiB), kSuccess);
  // Unmapped but still referenced: the memory is held until the last release.
  EXPECT_EQ(wait_for(0, {2 * MiB, 2 * MiB, 1, 0}), (Figures{2 * MiB, 2 * MiB, 1, 0}));
  ASSERT_EQ(v.release(again), kSuccess);
  EXPECT_EQ(wait_for(0, {}), Figures{});
  ASSERT_EQ(v.free(va, 2 * MiB), kSuccess);
}

TEST_F(ProgramVmm, BadArgumentsGetTheDriversAnswerAndCountNothing) {
  Vmm v = plain_symbols();
  Prop prop;
  std::uint64_t h = 0;
  // The fake answers CUDA_ERROR_INVALID_VALUE (1) / INVALID_HANDLE (400), as the driver does.
  EXPECT_EQ(v.create(nullptr, 2 * MiB, &prop, 0), 1);
  EXPECT_EQ(v.create(&h, 2 * MiB, nullptr, 0), 1);
  EXPECT_EQ(v.create(&h, 3 * MiB, &prop, 0), 1);  // not a multiple of the granularity
  EXPECT_EQ(v.release(0xdead), 1);
  EXPECT_EQ(v.retain(nullptr, nullptr), 1);
  EXPECT_EQ(v.retain(&h, nullptr), 1);
  EXPECT_EQ(v.unmap(0, 0), 1);
  EXPECT_EQ(v.unmap(0x1234000, 2 * MiB), 1);
  EXPECT_EQ(v.reserve(nullptr, 2 * MiB, 0, 0, 0), 1);
  EXPECT_EQ(v.free(0x1234000, 2 * MiB), 1);
  CUdeviceptr va = 0;
  ASSERT_EQ(v.reserve(&va, 2 * MiB, 0, 0, 0), kSuccess);
  EXPECT_EQ(v.map(va, 2 * MiB, 0, 0xbad, 0), 400);  // no such handle
  ASSERT_EQ(v.create(&h, 2 * MiB, &prop, 0), kSuccess);
  EXPECT_EQ(v.map(va, 4 * MiB, 0, h, 0), 1);  // larger than the handle
  ASSERT_EQ(v.release(h), kSuccess);
  EXPECT_EQ(v.release(h), 1);  // twice
  ASSERT_EQ(v.free(va, 2 * MiB), kSuccess);
  EXPECT_EQ(wait_for(0, {}), Figures{});
}

TEST_F(ProgramVmm, FreeMemoryAnswersLeaveOutWhatTheProgramHolds) {
  std::size_t free0 = 0, total0 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free0, &total0), kSuccess);
  Vmm v = plain_symbols();
  Prop prop;
  std::uint64_t h = 0;
  ASSERT_EQ(v.create(&h, 64 * MiB, &prop, 0), kSuccess);
  std::size_t free1 = 0, total1 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free1, &total1), kSuccess);
  EXPECT_EQ(total1, total0);
  EXPECT_LE(free1 + 64 * MiB, free0);
  ASSERT_EQ(v.release(h), kSuccess);
  std::size_t free2 = 0, total2 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free2, &total2), kSuccess);
  EXPECT_EQ(free2, free0);
}

// The pool's own backend creates and maps memory too (backend:cuda on the fake driver): none of
// it may count as the program's, or every byte the pool serves would be counted twice.
TEST_F(ProgramVmm, PoolAllocationsAreNotCountedAsTheProgramsOwn) {
  const bool cuda_backend = std::getenv("EXPECT_POOL_VMM") != nullptr;
  fakecuda_reset_calls();
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 64 * MiB), kSuccess);
  EXPECT_TRUE(shim::owns(p));
  if (cuda_backend) {
    // The pool really mapped driver memory, and the program can use it.
    EXPECT_GT(fakecuda_calls("cuMemCreate") + fakecuda_calls("cuMemMap"), 0);
    std::memset(p, 0x3c, 64 * MiB);
    EXPECT_EQ(static_cast<unsigned char*>(p)[64 * MiB - 1], 0x3c);
  }
  EXPECT_EQ(wait_for(0, {}), Figures{});
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a few more publishes
  EXPECT_EQ(recorded(0), std::optional<Figures>(Figures{}));
  ASSERT_EQ(cudaFree(p), kSuccess);
}

// --- served by the pool (backend:cuda only: the simulated backend's handles are not the driver's)
// --

// The properties the pool's handles have on the fake driver, which supports every attribute: POSIX
// file descriptors and RDMA (cuda_backend.cpp settles on them).
Prop pool_prop(int device) {
  Prop p;
  p.location_id = device;
  p.handle_types = 1;  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
  p.flags[1] = 1;      // allocFlags.gpuDirectRDMACapable
  return p;
}

long long trim_pool(int device) {
  auto trim = reinterpret_cast<long long (*)(int)>(dlsym(RTLD_DEFAULT, "gpustitch_trim"));
  return trim ? trim(device) : -1;
}

// The tests of serving: the pool on the driver's VMM, and none of its memory idle at the start.
class ProgramVmmServed : public ProgramVmm {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(ProgramVmm::SetUp());
    if (std::getenv("EXPECT_POOL_VMM") == nullptr) GTEST_SKIP() << "needs backend:cuda";
    ASSERT_GE(trim_pool(0), 0);
  }
};

// Waits until the record shows `served` bytes lent to the program; returns what it last showed.
std::uint64_t wait_served(int device, std::uint64_t served) {
  std::uint64_t last = ~0ull;
  for (int i = 0; i < 300; ++i) {
    if (auto c = recorded_counters(device)) {
      last = c->program_served_bytes;
      if (last == served) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return last;
}

// The program's round: reserve, create, map, write (or check), release, unmap, free.
struct Round {
  std::uint64_t handle = 0;
  bool wrote_and_read = false;
};
Round create_map_release(std::size_t size, const Prop& prop, unsigned char write,
                         int expect_read = -1) {
  Round out;
  Vmm v = plain_symbols();
  CUdeviceptr va = 0;
  EXPECT_EQ(v.reserve(&va, size, 0, 0, 0), kSuccess);
  EXPECT_EQ(v.create(&out.handle, size, &prop, 0), kSuccess);
  EXPECT_EQ(v.map(va, size, 0, out.handle, 0), kSuccess);
  int desc[3] = {1, prop.location_id, 3};
  EXPECT_EQ(cuMemSetAccess(va, size, desc, 1), kSuccess);
  auto* bytes = reinterpret_cast<unsigned char*>(va);
  bool ok = expect_read < 0 || (bytes[0] == expect_read && bytes[size - 1] == expect_read);
  std::memset(bytes, write, size);
  out.wrote_and_read = ok && bytes[size / 2] == write;
  EXPECT_EQ(v.release(out.handle), kSuccess);
  EXPECT_EQ(bytes[size - 1], write) << "released while mapped: the memory stays";
  EXPECT_EQ(v.unmap(va, size), kSuccess);
  EXPECT_EQ(v.free(va, size), kSuccess);
  return out;
}

TEST_F(ProgramVmmServed, ServedByThePoolWhereThePropertiesMatch) {
  constexpr std::size_t kSize = 8 * MiB;
  const std::uint64_t reserved0 = shim::stats(0).bytes_reserved;
  fakecuda_reset_calls();

  // First round: no idle handle of 8 MiB, so the driver creates it; the program's release is not
  // forwarded, and once unmapped the handle is the pool's.
  Round first = create_map_release(kSize, pool_prop(0), 0x6b);
  EXPECT_TRUE(first.wrote_and_read);
  EXPECT_EQ(fakecuda_calls("cuMemCreate"), 1);
  EXPECT_EQ(fakecuda_calls("cuMemRelease"), 0) << "the released handle went to the pool";
  EXPECT_EQ(shim::stats(0).bytes_reserved, reserved0 + kSize);
  EXPECT_EQ(wait_for(0, {}), Figures{});

  // Second round: served by the pool with that very handle, its bytes still there; while the
  // program holds it, the record counts it as the program's and as served, not as the pool's.
  Vmm v = plain_symbols();
  CUdeviceptr va = 0;
  ASSERT_EQ(v.reserve(&va, kSize, 0, 0, 0), kSuccess);
  const Prop prop = pool_prop(0);
  std::uint64_t h = 0;
  ASSERT_EQ(v.create(&h, kSize, &prop, 0), kSuccess);
  EXPECT_EQ(h, first.handle);
  EXPECT_EQ(fakecuda_calls("cuMemCreate"), 1) << "no new driver handle";
  ASSERT_EQ(v.map(va, kSize, 0, h, 0), kSuccess);
  allow_read_write(va, kSize, 0);
  auto* bytes = reinterpret_cast<unsigned char*>(va);
  EXPECT_EQ(bytes[0], 0x6b);
  EXPECT_EQ(bytes[kSize - 1], 0x6b);
  std::memset(bytes, 0x2e, kSize);
  EXPECT_EQ(bytes[kSize / 2], 0x2e);
  EXPECT_EQ(wait_for(0, {kSize, kSize, 1, kSize}), (Figures{kSize, kSize, 1, kSize}));
  EXPECT_EQ(wait_served(0, kSize), kSize);
  EXPECT_EQ(shim::stats(0).bytes_reserved, reserved0) << "lent: not the pool's while lent";
  if (auto c = recorded_counters(0)) {
    EXPECT_EQ(c->program_served_handles, 1u);
    EXPECT_EQ(c->bytes_reserved + c->program_held_bytes, reserved0 + kSize) << "counted once";
  }
  ASSERT_EQ(v.unmap(va, kSize), kSuccess);
  ASSERT_EQ(v.release(h), kSuccess);  // unmapped first this time: back at the release
  EXPECT_EQ(v.release(h), 1) << "released twice: the driver's answer";
  EXPECT_EQ(fakecuda_calls("cuMemRelease"), 0);
  EXPECT_EQ(wait_served(0, 0), 0u);
  EXPECT_EQ(shim::stats(0).bytes_reserved, reserved0 + kSize);
  ASSERT_EQ(v.free(va, kSize), kSuccess);

  // The pool's own allocation reuses that memory: no new driver handle, the program's bytes.
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, kSize), kSuccess);
  EXPECT_EQ(fakecuda_calls("cuMemCreate"), 1);
  EXPECT_EQ(static_cast<unsigned char*>(p)[0], 0x2e);
  EXPECT_EQ(static_cast<unsigned char*>(p)[kSize - 1], 0x2e);
  ASSERT_EQ(cudaFree(p), kSuccess);
  // And trim gives it back to the driver like the pool's own memory.
  EXPECT_GE(trim_pool(0), static_cast<long long>(kSize));
  EXPECT_EQ(fakecuda_calls("cuMemRelease"), 1);
  EXPECT_EQ(wait_for(0, {}), Figures{});
}

TEST_F(ProgramVmmServed, NotServedWhereThePropertiesDiffer) {
  constexpr std::size_t kSize = 6 * MiB;
  // An idle 6 MiB handle in the pool (a first round with the pool's properties).
  const Round kept = create_map_release(kSize, pool_prop(0), 0x11);
  fakecuda_reset_calls();

  // Another handle type (FABRIC): the driver's, and released to it.
  Prop fabric = pool_prop(0);
  fabric.handle_types = 0x8;
  const Round foreign = create_map_release(kSize, fabric, 0x22);
  EXPECT_NE(foreign.handle, kept.handle);
  EXPECT_EQ(fakecuda_calls("cuMemCreate"), 1);
  EXPECT_EQ(fakecuda_calls("cuMemRelease"), 1);
  int creates = 1;
  // A size the pool does not hold: the driver's.
  const Round bigger = create_map_release(2 * kSize, pool_prop(0), 0x33);
  EXPECT_NE(bigger.handle, kept.handle);
  EXPECT_EQ(fakecuda_calls("cuMemCreate"), ++creates);

  Prop no_rdma = pool_prop(0);
  no_rdma.flags[1] = 0;
  // Asked for less than the pool's handles have (no RDMA): the idle handle serves it, but a handle
  // the driver creates that way is not the pool's kind and is released to the driver.
  const Round lent = create_map_release(kSize, no_rdma, 0x44, 0x11);
  EXPECT_EQ(lent.handle, kept.handle);
  EXPECT_TRUE(lent.wrote_and_read) << "served with the bytes of the idle handle";
  EXPECT_EQ(fakecuda_calls("cuMemCreate"), creates);
  const int released = fakecuda_calls("cuMemRelease");
  (void)create_map_release(4 * MiB, no_rdma, 0x55);
  EXPECT_EQ(fakecuda_calls("cuMemCreate"), ++creates);
  EXPECT_EQ(fakecuda_calls("cuMemRelease"), released + 1);

  // flags != 0: the driver's answer (the fake, as CUDA, takes none).
  std::uint64_t h = 0;
  const Prop prop = pool_prop(0);
  EXPECT_EQ(plain_symbols().create(&h, kSize, &prop, 1), 1);
  EXPECT_EQ(wait_served(0, 0), 0u);
  EXPECT_EQ(wait_for(0, {}), Figures{});
  EXPECT_EQ(wait_for(1, {}), Figures{});
}

// An exported handle may live on in the process that imported it: it never becomes the pool's.
TEST_F(ProgramVmmServed, ExportedHandlesGoBackToTheDriver) {
  constexpr std::size_t kSize = 10 * MiB;
  const std::uint64_t reserved0 = shim::stats(0).bytes_reserved;
  auto exporter = reinterpret_cast<int (*)(void*, std::uint64_t, int, unsigned long long)>(
      dlsym(libcuda(), "cuMemExportToShareableHandle"));
  ASSERT_NE(exporter, nullptr);
  EXPECT_EQ(shim::library_of(reinterpret_cast<void*>(exporter)), "libgpustitch.so");
  const Vmm v = plain_symbols();
  const Prop prop = pool_prop(0);
  auto export_fd = [&](std::uint64_t h) {
    int fd = -1;
    EXPECT_EQ(exporter(&fd, h, 1, 0), kSuccess);
    EXPECT_GE(fd, 0);
    ::close(fd);
  };
  fakecuda_reset_calls();

  // The driver's handle, exported: released to the driver.
  std::uint64_t h = 0;
  ASSERT_EQ(v.create(&h, kSize, &prop, 0), kSuccess);
  export_fd(h);
  ASSERT_EQ(v.release(h), kSuccess);
  EXPECT_EQ(fakecuda_calls("cuMemRelease"), 1);
  EXPECT_EQ(shim::stats(0).bytes_reserved, reserved0) << "not the pool's";

  // Not exported: the pool's once released.
  ASSERT_EQ(v.create(&h, kSize, &prop, 0), kSuccess);
  EXPECT_EQ(fakecuda_calls("cuMemCreate"), 2);
  ASSERT_EQ(v.release(h), kSuccess);
  EXPECT_EQ(fakecuda_calls("cuMemRelease"), 1);
  EXPECT_EQ(shim::stats(0).bytes_reserved, reserved0 + kSize);

  // Lent by the pool, then exported: the pool forgets it, and it goes to the driver.
  std::uint64_t lent = 0;
  ASSERT_EQ(v.create(&lent, kSize, &prop, 0), kSuccess);
  EXPECT_EQ(lent, h);
  EXPECT_EQ(fakecuda_calls("cuMemCreate"), 2);
  export_fd(lent);
  ASSERT_EQ(v.release(lent), kSuccess);
  EXPECT_EQ(fakecuda_calls("cuMemRelease"), 2);
  EXPECT_EQ(shim::stats(0).bytes_reserved, reserved0);
  EXPECT_EQ(wait_served(0, 0), 0u);
  EXPECT_EQ(wait_for(0, {}), Figures{});
}

}  // namespace
