// Small vocabulary types shared by every layer of the allocator core.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace gpustitch {

// A device virtual address. Kept as an integer so the core never dereferences it.
using DevPtr = std::uintptr_t;

// An opaque physical-memory handle (CUmemGenericAllocationHandle on CUDA, an index on the
// simulated backend).
using PhysHandle = std::uint64_t;

// An opaque event handle (CUevent on CUDA, an index on the simulated backend).
using Event = std::uint64_t;

// Identity of a CUDA stream (the CUstream value). Only compared, never dereferenced.
using Stream = std::uintptr_t;

// Frees with this stream have cudaFree semantics: any stream may still be using the memory, so
// it is reusable only after a device-wide fence. Allocations with it (cudaMalloc) may be used by
// any stream, so they take only fenced memory.
inline constexpr Stream kAnyStream = ~Stream{0};

// A thread's per-thread default stream (cudaStreamPerThread) is one CUstream value for every
// thread, so the preload shim gives each thread's its own key: odd, with these low four bits (a
// CUstream handle is an aligned pointer or 0, 1, 2). A backend acting on such a key (record_event)
// acts on the calling thread's per-thread stream.
inline constexpr Stream kPerThreadStreamTag = 0x3;
inline constexpr bool is_per_thread_stream(Stream s) noexcept {
  return s != kAnyStream && (s & 0xF) == kPerThreadStreamTag;
}

enum class Status : int {
  ok = 0,
  out_of_memory,    // not enough physical memory, even after trimming and stitching
  invalid_value,    // bad argument (unknown pointer, zero device count, ...)
  invalid_device,   // device ordinal out of range
  not_supported,    // the backend cannot do this (no VMM support, ...)
  not_initialized,  // no driver / backend unusable
  error,            // any other backend failure
};

const char* to_string(Status s) noexcept;

// A GPU's UUID, as cuDeviceGetUuid returns it (16 raw bytes).
using DeviceUuid = std::array<std::uint8_t, 16>;

inline constexpr std::size_t KiB = 1024;
inline constexpr std::size_t MiB = 1024 * KiB;
inline constexpr std::size_t GiB = 1024 * MiB;

inline constexpr std::size_t align_up(std::size_t v, std::size_t a) noexcept {
  return (v + a - 1) / a * a;
}
inline constexpr std::size_t align_down(std::size_t v, std::size_t a) noexcept {
  return v / a * a;
}

}  // namespace gpustitch
