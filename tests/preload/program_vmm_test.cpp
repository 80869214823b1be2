// Memory a program maps itself with the CUDA VMM API (cuMemCreate, cuMemMap, ...), as XLA,
// PyTorch's expandable segments and NCCL do: under LD_PRELOAD=libgpustitch.so every such call
// reaches the fake driver with its arguments unchanged, whichever way the program found the entry
// point (plain symbol, dlsym, cuGetProcAddress, cudaGetDriverEntryPoint), and what the program
// holds that way shows in its statistics record (program_* fields). The pool's own VMM calls
// (backend:cuda on the fake driver) are never counted.
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

// This process's figures for device as its statistics record shows them.
std::optional<Figures> recorded(int device) {
  using namespace gpustitch::shm;
  for (const RecordName& n : discover_records(kDefaultPrefix, ::geteuid())) {
    if (n.pid != ::getpid()) continue;
    ReadError err{};
    auto r = RecordReader::open(n, ::geteuid(), &err);
    SnapshotCopy snap;
    if (!r || r->read_snapshot(&snap) != ReadError::none) return std::nullopt;
    if (device >= static_cast<int>(snap.devices.size())) return std::nullopt;
    const DeviceCounters& d = snap.devices[device];
    return Figures{d.program_held_bytes, d.program_created_bytes, d.program_handles,
                   d.program_mapped_bytes};
  }
  return std::nullopt;
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

}  // namespace
