// See program_lending.h.
#include "program_lending.h"

#include <cstdint>
#include <cstring>

#include "hooks.h"
#include "real_api.h"
#include "shim.h"

namespace gpustitch::preload {
namespace {

// The fields of a CUmemAllocationProp the decision reads (offsets in cuda_abi.h).
struct Request {
  int type = 0;
  unsigned handle_types = 0;
  int location_type = 0;
  int device = -1;
  unsigned char compression = 0;
  unsigned char rdma = 0;
  std::uint16_t usage = 0;
};

Request read_request(const void* prop) noexcept {
  const auto* p = static_cast<const unsigned char*>(prop);
  Request r;
  int location[2];
  std::memcpy(&r.type, p + cuda::kAllocationPropTypeOffset, sizeof r.type);
  std::memcpy(&r.handle_types, p + cuda::kAllocationPropHandleTypesOffset, sizeof r.handle_types);
  std::memcpy(location, p + cuda::kAllocationPropLocationOffset, sizeof location);
  r.location_type = location[0];
  r.device = location[1];
  r.compression = p[cuda::kAllocationPropCompressionOffset];
  r.rdma = p[cuda::kAllocationPropRdmaOffset];
  std::memcpy(&r.usage, p + cuda::kAllocationPropUsageOffset, sizeof r.usage);
  return r;
}

}  // namespace

bool lend_to_program(std::size_t size, const void* prop, unsigned long long flags,
                     cuda::CUmemGenericAllocationHandle* out, PoolTerms* terms) noexcept {
  *terms = PoolTerms{};
  if (prop == nullptr || out == nullptr || flags != 0 || size == 0) return false;
  const Request r = read_request(prop);
  if (r.type != cuda::CU_MEM_ALLOCATION_TYPE_PINNED ||
      r.location_type != cuda::CU_MEM_LOCATION_TYPE_DEVICE || r.usage != 0 ||
      (r.handle_types & ~static_cast<unsigned>(cuda::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) !=
          0) {
    return false;
  }
  Pool* pool = serving_pool();
  if (pool == nullptr || !pool->config().serve_program_vmm || r.device < 0 ||
      r.device >= pool->device_count()) {
    return false;
  }
  HandleProperties have;
  if (pool->backend().handle_properties(r.device, &have) != Status::ok || !have.driver_handles) {
    return false;
  }
  const HandleProperties wanted{true, r.handle_types, r.rdma != 0, r.compression};
  terms->props = wanted;
  terms->kept = wanted == have;  // a handle the driver creates for this call is like the pool's
  PhysHandle h = 0;
  if (pool->lend_handle(r.device, size, wanted, &h) != Status::ok) return false;
  *out = h;
  terms->kept = true;
  terms->props = have;  // the pool's handle, with the pool's properties
  return true;
}

bool retire_kept_handle(int device, cuda::CUmemGenericAllocationHandle handle, std::size_t size,
                        const HandleProperties& props, bool reusable) noexcept {
  if (Pool* pool = existing_pool()) {
    if (reusable) {
      if (pool->take_back_handle(device, handle, size, props)) return true;
    } else {
      // Properties none of the pool's driver handles has: the pool forgets a handle it lent and
      // takes nothing.
      pool->take_back_handle(device, handle, size, HandleProperties{});
    }
  }
  if (auto release = real_as<cuda::PFN_cuMemRelease>(Hook::cuMemRelease)) release(handle);
  return false;
}

}  // namespace gpustitch::preload
