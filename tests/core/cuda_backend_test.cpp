// The CUDA backend against a scripted stand-in driver, passed in through the DriverResolver (the
// same door the preload shim uses), so its logic runs in CI without a GPU: entry-point loading,
// the VMM capability check, the CUresult -> Status mapping, the optional allocation properties,
// the map-offset probe, and above all the context promise: mem_info and synchronize run with the
// device's primary context current, VMM calls get a context when the thread has none, and the
// caller's thread always leaves with the context stack it came with.
#include <cuda.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "gpustitch/cuda_backend.h"

using gpustitch::DevPtr;
using gpustitch::MiB;
using gpustitch::PhysHandle;
using gpustitch::Status;

namespace {

constexpr std::size_t kGranularity = 2 * MiB;

// What the stand-in driver does and what it saw.
struct FakeDriver {
  int devices = 2;
  std::vector<int> vmm = {1, 1};
  bool accept_offset = true;
  bool reject_rdma = false;
  std::size_t capacity = 1024 * MiB;
  CUresult init_result = CUDA_SUCCESS;
  CUresult next_error = CUDA_SUCCESS;  // returned once by the next VMM call
  std::map<int, int> retained;         // device -> primary context references
  CUcontext ctx_at_mem_info = nullptr, ctx_at_sync = nullptr, ctx_at_vmm = nullptr;
  CUmemAllocationProp last_prop{};
  std::vector<CUmemAccessDesc> last_access;
  std::uint64_t next_handle = 1;
  CUdeviceptr next_va = 0x7f0000000000ull;
  // Events: the context each was created in, the stream of the last record, query answers.
  bool events = true;  // whether the event entry points resolve
  std::map<CUevent, CUcontext> event_ctx;
  std::uintptr_t next_event = 0x5000;
  CUstream last_record_stream = nullptr;
  CUcontext ctx_at_record = nullptr;
  CUresult query_result = CUDA_SUCCESS;
};
FakeDriver fake;
thread_local std::vector<CUcontext> ctx_stack;

CUcontext primary_of(int dev) {
  return reinterpret_cast<CUcontext>(0x1000 + dev);
}
CUcontext current() {
  return ctx_stack.empty() ? nullptr : ctx_stack.back();
}
CUresult take_error() {
  const CUresult r = fake.next_error;
  fake.next_error = CUDA_SUCCESS;
  return r;
}

CUresult f_init(unsigned) {
  return fake.init_result;
}
CUresult f_version(int* v) {
  return *v = 13000, CUDA_SUCCESS;
}
CUresult f_count(int* n) {
  return *n = fake.devices, CUDA_SUCCESS;
}
CUresult f_get(CUdevice* d, int i) {
  if (i < 0 || i >= fake.devices) return CUDA_ERROR_INVALID_DEVICE;
  *d = i;
  return CUDA_SUCCESS;
}
CUresult f_attr(int* v, CUdevice_attribute a, CUdevice d) {
  if (a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
    *v = fake.vmm[d];
  else
    *v = 1;
  return CUDA_SUCCESS;
}
CUresult f_retain(CUcontext* c, CUdevice d) {
  ++fake.retained[d];
  *c = primary_of(d);
  return CUDA_SUCCESS;
}
CUresult f_release(CUdevice d) {
  return --fake.retained[d], CUDA_SUCCESS;
}
CUresult f_get_current(CUcontext* c) {
  return *c = current(), CUDA_SUCCESS;
}
CUresult f_push(CUcontext c) {
  return ctx_stack.push_back(c), CUDA_SUCCESS;
}
CUresult f_pop(CUcontext* c) {
  if (ctx_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (c) *c = ctx_stack.back();
  ctx_stack.pop_back();
  return CUDA_SUCCESS;
}
CUresult f_sync() {
  fake.ctx_at_sync = current();
  return current() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}
CUresult f_mem_info(std::size_t* free, std::size_t* total) {
  fake.ctx_at_mem_info = current();
  if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
  *free = fake.capacity / 2;
  *total = fake.capacity;
  return CUDA_SUCCESS;
}
CUresult f_granularity(std::size_t* g, const CUmemAllocationProp*,
                       CUmemAllocationGranularity_flags) {
  *g = kGranularity;
  return CUDA_SUCCESS;
}
CUresult f_reserve(CUdeviceptr* p, std::size_t size, std::size_t, CUdeviceptr, unsigned long long) {
  fake.ctx_at_vmm = current();
  if (const CUresult r = take_error()) return r;
  *p = fake.next_va;
  fake.next_va += size + kGranularity;
  return CUDA_SUCCESS;
}
CUresult f_free(CUdeviceptr, std::size_t) {
  return take_error();
}
CUresult f_create(CUmemGenericAllocationHandle* h, std::size_t size,
                  const CUmemAllocationProp* prop, unsigned long long) {
  fake.ctx_at_vmm = current();
  if (const CUresult r = take_error()) return r;
  if (fake.reject_rdma && prop->allocFlags.gpuDirectRDMACapable) return CUDA_ERROR_NOT_SUPPORTED;
  if (size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (size > fake.capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  fake.last_prop = *prop;
  *h = fake.next_handle++;
  return CUDA_SUCCESS;
}
CUresult f_mem_release(CUmemGenericAllocationHandle) {
  return take_error();
}
CUresult f_map(CUdeviceptr, std::size_t, std::size_t offset, CUmemGenericAllocationHandle,
               unsigned long long) {
  fake.ctx_at_vmm = current();
  if (const CUresult r = take_error()) return r;
  return offset != 0 && !fake.accept_offset ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult f_unmap(CUdeviceptr, std::size_t) {
  return take_error();
}
CUresult f_set_access(CUdeviceptr, std::size_t, const CUmemAccessDesc* d, std::size_t n) {
  fake.ctx_at_vmm = current();
  fake.last_access.assign(d, d + n);
  return take_error();
}

CUresult f_event_create(CUevent* e, unsigned flags) {
  if (flags != CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_VALUE;
  *e = reinterpret_cast<CUevent>(fake.next_event += 0x10);
  fake.event_ctx[*e] = current();
  return CUDA_SUCCESS;
}
CUresult f_event_destroy(CUevent e) {
  return fake.event_ctx.erase(e) != 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
CUresult f_event_record(CUevent e, CUstream s) {
  if (fake.event_ctx.count(e) == 0) return CUDA_ERROR_INVALID_HANDLE;
  fake.last_record_stream = s;
  fake.ctx_at_record = current();
  return take_error();
}
CUresult f_event_query(CUevent e) {
  return fake.event_ctx.count(e) == 0 ? CUDA_ERROR_INVALID_HANDLE : fake.query_result;
}

void* resolve(const char* name, void*) {
  static const std::map<std::string, void*> table = {
      {"cuInit", (void*)&f_init},
      {"cuDriverGetVersion", (void*)&f_version},
      {"cuDeviceGetCount", (void*)&f_count},
      {"cuDeviceGet", (void*)&f_get},
      {"cuDeviceGetAttribute", (void*)&f_attr},
      {"cuDevicePrimaryCtxRetain", (void*)&f_retain},
      {"cuDevicePrimaryCtxRelease", (void*)&f_release},
      {"cuCtxGetCurrent", (void*)&f_get_current},
      {"cuCtxPushCurrent", (void*)&f_push},
      {"cuCtxPopCurrent", (void*)&f_pop},
      {"cuCtxSynchronize", (void*)&f_sync},
      {"cuMemGetInfo", (void*)&f_mem_info},
      {"cuMemGetAllocationGranularity", (void*)&f_granularity},
      {"cuMemAddressReserve", (void*)&f_reserve},
      {"cuMemAddressFree", (void*)&f_free},
      {"cuMemCreate", (void*)&f_create},
      {"cuMemRelease", (void*)&f_mem_release},
      {"cuMemMap", (void*)&f_map},
      {"cuMemUnmap", (void*)&f_unmap},
      {"cuMemSetAccess", (void*)&f_set_access},
      {"cuEventCreate", (void*)&f_event_create},
      {"cuEventDestroy", (void*)&f_event_destroy},
      {"cuEventRecord", (void*)&f_event_record},
      {"cuEventQuery", (void*)&f_event_query},
  };
  if (!fake.events && std::strncmp(name, "cuEvent", 7) == 0) return nullptr;
  auto it = table.find(name);
  return it == table.end() ? nullptr : it->second;
}

void* resolve_nothing(const char*, void*) {
  return nullptr;
}

class CudaBackendFakeDriver : public ::testing::Test {
 protected:
  void SetUp() override {
    fake = FakeDriver{};
    ctx_stack.clear();
  }
  std::unique_ptr<gpustitch::Backend> load(std::string* why = nullptr) {
    std::string local;
    return gpustitch::make_cuda_backend(why ? why : &local, &resolve, nullptr);
  }
};

TEST_F(CudaBackendFakeDriver, MissingEntryPointIsReportedByName) {
  std::string why;
  EXPECT_EQ(gpustitch::make_cuda_backend(&why, &resolve_nothing, nullptr), nullptr);
  EXPECT_NE(why.find("cuInit"), std::string::npos) << why;
}

TEST_F(CudaBackendFakeDriver, NoDeviceOrFailedInitGivesNull) {
  std::string why;
  fake.init_result = CUDA_ERROR_NO_DEVICE;
  EXPECT_EQ(load(&why), nullptr);
  EXPECT_NE(why.find("no CUDA device"), std::string::npos) << why;
  fake.init_result = CUDA_SUCCESS;
  fake.devices = 0;
  EXPECT_EQ(load(&why), nullptr);
}

TEST_F(CudaBackendFakeDriver, DeviceWithoutVmmRefusesAndReleasesContexts) {
  fake.vmm = {1, 0};
  std::string why;
  EXPECT_EQ(load(&why), nullptr);
  EXPECT_NE(why.find("device 1 lacks VMM support"), std::string::npos) << why;
  for (auto [dev, refs] : fake.retained) EXPECT_EQ(refs, 0) << "device " << dev;
  EXPECT_TRUE(ctx_stack.empty());
}

TEST_F(CudaBackendFakeDriver, LoadsDevicesAndReleasesContextsOnDestruction) {
  {
    auto be = load();
    ASSERT_NE(be, nullptr);
    EXPECT_STREQ(be->name(), "cuda");
    EXPECT_EQ(be->device_count(), 2);
    EXPECT_EQ(be->granularity(0), kGranularity);
    EXPECT_EQ(be->granularity(2), 0u);
    EXPECT_TRUE(be->supports_map_offset(1));
    EXPECT_EQ(fake.retained[0], 1);
    EXPECT_EQ(fake.retained[1], 1);
    EXPECT_TRUE(ctx_stack.empty()) << "loading leaves the caller's context stack as it was";
  }
  EXPECT_EQ(fake.retained[0], 0);
  EXPECT_EQ(fake.retained[1], 0);
}

TEST_F(CudaBackendFakeDriver, MapOffsetProbeFollowsTheDriver) {
  fake.accept_offset = false;
  auto be = load();
  ASSERT_NE(be, nullptr);
  EXPECT_FALSE(be->supports_map_offset(0));
  EXPECT_FALSE(be->supports_map_offset(1));
}

TEST_F(CudaBackendFakeDriver, RequestsExportableRdmaHandlesAndDropsWhatIsRejected) {
  {
    auto be = load();
    ASSERT_NE(be, nullptr);
    PhysHandle h = 0;
    ASSERT_EQ(be->create(1, kGranularity, &h), Status::ok);
    EXPECT_EQ(fake.last_prop.type, CU_MEM_ALLOCATION_TYPE_PINNED);
    EXPECT_EQ(fake.last_prop.location.type, CU_MEM_LOCATION_TYPE_DEVICE);
    EXPECT_EQ(fake.last_prop.location.id, 1);
    EXPECT_EQ(fake.last_prop.requestedHandleTypes, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    EXPECT_EQ(fake.last_prop.allocFlags.gpuDirectRDMACapable, 1);
  }
  fake.reject_rdma = true;
  auto be = load();
  ASSERT_NE(be, nullptr) << "an unsupported optional property does not disable the backend";
  PhysHandle h = 0;
  ASSERT_EQ(be->create(0, kGranularity, &h), Status::ok);
  EXPECT_EQ(fake.last_prop.allocFlags.gpuDirectRDMACapable, 0);
  EXPECT_EQ(fake.last_prop.requestedHandleTypes, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

// ipc:native (shareable false): pool memory is never exported, so no handle asks for the type,
// and export_handle says not_supported, as it does for a driver without the export entry point.
TEST_F(CudaBackendFakeDriver, WithoutShareableHandlesNothingIsExportable) {
  std::string why;
  auto be = gpustitch::make_cuda_backend(&why, &resolve, nullptr, /*shareable=*/false);
  ASSERT_NE(be, nullptr) << why;
  PhysHandle h = 0;
  ASSERT_EQ(be->create(0, kGranularity, &h), Status::ok);
  EXPECT_EQ(fake.last_prop.requestedHandleTypes, CU_MEM_HANDLE_TYPE_NONE);
  EXPECT_EQ(fake.last_prop.allocFlags.gpuDirectRDMACapable, 1);
  int fd = -1;
  EXPECT_EQ(be->export_handle(h, &fd), Status::not_supported);
  EXPECT_EQ(fd, -1);
  auto shareable = load();
  ASSERT_NE(shareable, nullptr);
  ASSERT_EQ(shareable->create(0, kGranularity, &h), Status::ok);
  EXPECT_EQ(fake.last_prop.requestedHandleTypes, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  EXPECT_EQ(shareable->export_handle(h, &fd), Status::not_supported)
      << "this stand-in driver has no cuMemExportToShareableHandle";
}

TEST_F(CudaBackendFakeDriver, DeviceQueriesRunInThatDevicesPrimaryContext) {
  auto be = load();
  ASSERT_NE(be, nullptr);
  const CUcontext mine = reinterpret_cast<CUcontext>(0xabc);
  ctx_stack.push_back(mine);
  std::size_t free = 0, total = 0;
  ASSERT_EQ(be->mem_info(1, &free, &total), Status::ok);
  EXPECT_EQ(fake.ctx_at_mem_info, primary_of(1));
  EXPECT_EQ(total, fake.capacity);
  ASSERT_EQ(be->synchronize(0), Status::ok);
  EXPECT_EQ(fake.ctx_at_sync, primary_of(0));
  ASSERT_EQ(ctx_stack.size(), 1u);
  EXPECT_EQ(ctx_stack.back(), mine) << "the caller's context is current again";
}

TEST_F(CudaBackendFakeDriver, VmmCallsGetAContextOnlyWhenTheThreadHasNone) {
  auto be = load();
  ASSERT_NE(be, nullptr);
  DevPtr va = 0;
  ASSERT_EQ(be->reserve(1, kGranularity, &va), Status::ok);
  EXPECT_EQ(fake.ctx_at_vmm, primary_of(1));
  EXPECT_TRUE(ctx_stack.empty());

  const CUcontext mine = reinterpret_cast<CUcontext>(0xabc);
  ctx_stack.push_back(mine);
  PhysHandle h = 0;
  ASSERT_EQ(be->create(0, kGranularity, &h), Status::ok);
  EXPECT_EQ(fake.ctx_at_vmm, mine) << "a current context is left in place";
  ASSERT_EQ(be->map(va, kGranularity, h, 0), Status::ok);
  EXPECT_EQ(fake.ctx_at_vmm, mine);
  ASSERT_EQ(ctx_stack.size(), 1u);
}

TEST_F(CudaBackendFakeDriver, SetAccessDescribesEachDeviceReadWrite) {
  auto be = load();
  ASSERT_NE(be, nullptr);
  const int devices[] = {1, 0};
  ASSERT_EQ(be->set_access(0x7f0000000000ull, kGranularity, devices), Status::ok);
  ASSERT_EQ(fake.last_access.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(fake.last_access[i].location.type, CU_MEM_LOCATION_TYPE_DEVICE);
    EXPECT_EQ(fake.last_access[i].location.id, devices[i]);
    EXPECT_EQ(fake.last_access[i].flags, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  }
  const int bad[] = {0, 2};
  EXPECT_EQ(be->set_access(0x7f0000000000ull, kGranularity, bad), Status::invalid_device);
  EXPECT_EQ(be->set_access(0x7f0000000000ull, kGranularity, {}), Status::invalid_value);
}

TEST_F(CudaBackendFakeDriver, DriverErrorsMapToStatus) {
  auto be = load();
  ASSERT_NE(be, nullptr);
  PhysHandle h = 0;
  DevPtr va = 0;
  EXPECT_EQ(be->create(0, 2 * fake.capacity, &h), Status::out_of_memory);
  const std::pair<CUresult, Status> cases[] = {
      {CUDA_ERROR_OUT_OF_MEMORY, Status::out_of_memory},
      {CUDA_ERROR_INVALID_VALUE, Status::invalid_value},
      {CUDA_ERROR_INVALID_DEVICE, Status::invalid_device},
      {CUDA_ERROR_NOT_SUPPORTED, Status::not_supported},
      {CUDA_ERROR_NO_DEVICE, Status::not_initialized},
      {CUDA_ERROR_NOT_INITIALIZED, Status::not_initialized},
      {CUDA_ERROR_DEINITIALIZED, Status::not_initialized},
      {CUDA_ERROR_ILLEGAL_ADDRESS, Status::error},
      {CUDA_ERROR_UNKNOWN, Status::error},
  };
  for (auto [result, status] : cases) {
    fake.next_error = result;
    EXPECT_EQ(be->map(0x7f0000000000ull, kGranularity, 1, 0), status) << "CUresult " << result;
    fake.next_error = result;
    EXPECT_EQ(be->reserve(0, kGranularity, &va), status) << "CUresult " << result;
  }
  EXPECT_EQ(be->reserve(5, kGranularity, &va), Status::invalid_device);
  EXPECT_EQ(be->create(-1, kGranularity, &h), Status::invalid_device);
  std::size_t free = 0, total = 0;
  EXPECT_EQ(be->mem_info(2, &free, &total), Status::invalid_device);
  EXPECT_EQ(be->synchronize(2), Status::invalid_device);
  EXPECT_TRUE(ctx_stack.empty());
}

}  // namespace

// The events of stream-ordered frees (core/src/free_events.h): created in the device's primary
// context without timing, recorded on the stream the free named (a per-thread key on the
// calling thread's per-thread stream, 0 on the legacy one), "not ready" an answer and not an
// error, and without the entry points (an old driver) not_supported, so that the pool fences.
TEST_F(CudaBackendFakeDriver, EventsAreRecordedOnTheFreesStreamAndQueriedWithoutWaiting) {
  auto be = load();
  ASSERT_NE(be, nullptr);
  gpustitch::Event e = 0;
  ASSERT_EQ(be->create_event(1, &e), Status::ok);
  EXPECT_EQ(fake.event_ctx[reinterpret_cast<CUevent>(e)], primary_of(1));
  EXPECT_TRUE(ctx_stack.empty());
  EXPECT_EQ(be->create_event(2, &e), Status::invalid_device);

  const gpustitch::Stream user_stream = 0x7e5000;
  ASSERT_EQ(be->record_event(1, e, user_stream), Status::ok);
  EXPECT_EQ(fake.last_record_stream, reinterpret_cast<CUstream>(user_stream));
  EXPECT_EQ(fake.ctx_at_record, primary_of(1)) << "a thread without a context gets the device's";
  EXPECT_TRUE(ctx_stack.empty());
  EXPECT_EQ(be->record_event(2, e, user_stream), Status::invalid_device);
  ASSERT_EQ(be->record_event(1, e, (std::uintptr_t{41} << 4) | gpustitch::kPerThreadStreamTag),
            Status::ok);
  EXPECT_EQ(fake.last_record_stream, CU_STREAM_PER_THREAD);
  ASSERT_EQ(be->record_event(1, e, 0), Status::ok);
  EXPECT_EQ(fake.last_record_stream, CU_STREAM_LEGACY);
  fake.next_error = CUDA_ERROR_INVALID_HANDLE;  // a stream of another context
  EXPECT_NE(be->record_event(1, e, user_stream), Status::ok);

  bool done = false;
  EXPECT_EQ(be->query_event(e, &done), Status::ok);
  EXPECT_TRUE(done);
  fake.query_result = CUDA_ERROR_NOT_READY;
  EXPECT_EQ(be->query_event(e, &done), Status::ok);
  EXPECT_FALSE(done);
  fake.query_result = CUDA_ERROR_LAUNCH_FAILED;
  EXPECT_NE(be->query_event(e, &done), Status::ok);
  EXPECT_FALSE(done);
  EXPECT_EQ(be->destroy_event(e), Status::ok);
  EXPECT_TRUE(fake.event_ctx.empty());

  fake.events = false;
  auto old = load();
  ASSERT_NE(old, nullptr) << "events are optional";
  EXPECT_EQ(old->create_event(0, &e), Status::not_supported);
}
