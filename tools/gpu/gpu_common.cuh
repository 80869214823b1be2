// Shared bits of the GPU compatibility programs: a deterministic word pattern, error checks that
// print FAIL and exit, and the result lines run-matrix.sh parses:
//   PASS: <program> ... | FAIL: <program> ...
//   checksum: <decimal>      (must be equal with and without the shim)
//   wall_ms: <milliseconds>
//   bytes: {json}            (report_bytes: the byte accounting of run-matrix.sh's shim runs)
#pragma once

#include <cuda_runtime.h>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

__host__ __device__ inline std::uint32_t word_at(std::uint64_t i, std::uint32_t seed) {
  std::uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(seed) << 32);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<std::uint32_t>(x);
}

#define CUDA_CHECK(call)                                                                       \
  do {                                                                                         \
    const cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                                   \
      std::printf("FAIL: %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

struct WallClock {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double ms() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
};

// A small deterministic generator (the same sequence on every machine and run).
struct Lcg {
  std::uint64_t s;
  explicit Lcg(std::uint64_t seed) : s(seed * 6364136223846793005ull + 1442695040888963407ull) {}
  std::uint64_t next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return s >> 11;
  }
  // Log-uniform in [lo, hi].
  std::size_t log_size(std::size_t lo, std::size_t hi) {
    int bits_lo = 0, bits_hi = 0;
    while ((std::size_t{1} << bits_lo) < lo) ++bits_lo;
    while ((std::size_t{1} << bits_hi) < hi) ++bits_hi;
    const int b = bits_lo + static_cast<int>(next() % static_cast<unsigned>(bits_hi - bits_lo + 1));
    const std::size_t base = std::size_t{1} << b;
    std::size_t v = base + next() % base;
    if (v < lo) v = lo;
    if (v > hi) v = hi;
    return v;
  }
};

// With the program's memory live: where GPUSTITCH_MATRIX_BYTES names tools/gpu/matrix_bytes.py
// (run-matrix.sh sets it for the shim runs), runs `python3 THAT program --pid PID --live BYTES`
// and passes on its `bytes:` line, which compares the pool's and NVML's figures for this process
// with the bytes the program holds. Without it, nothing.
inline void report_bytes(std::uint64_t live_bytes) {
  const char* script = std::getenv("GPUSTITCH_MATRIX_BYTES");
  if (script == nullptr || *script == '\0') return;
  if (cudaDeviceSynchronize() != cudaSuccess) return;
  const std::string cmd = std::string("python3 '") + script + "' program --pid " +
                          std::to_string(static_cast<long long>(getpid())) + " --live " +
                          std::to_string(static_cast<unsigned long long>(live_bytes));
  std::fflush(stdout);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return;
  char line[4096];
  while (std::fgets(line, sizeof line, p) != nullptr) std::fputs(line, stdout);
  pclose(p);
  std::fflush(stdout);
}
