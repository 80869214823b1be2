// free_while_busy: memory freed while a kernel still writes it must never be handed to a new
// allocation that someone else then fills.
//
// Each iteration: buffer A is allocated and a long kernel (--kernel-ms, default 5 ms) keeps
// writing pattern P_A over it on stream s1; the host frees A at once, allocates a buffer B of the
// same size at once and fills it with pattern P_B on another stream s2. Natively cudaFree waits for
// the device, so B can never overlap a live A. An allocator that hands A's memory to B too early
// lets the long kernel overwrite B after its fill: a corruption. Iterations alternate between
// cudaMalloc/cudaFree and cudaMallocAsync(s2)/cudaFreeAsync(s1) (a stream-ordered free must not be
// reused by another stream before the freeing stream's work is done), and rotate over four
// writer and four filler streams, half of them non-blocking. Every --window iterations the device
// is synchronised and a kernel compares every B against P_B, counting mismatched words, then the
// B buffers are freed. Sizes rotate over 64 KiB, 2 MiB, 8 MiB and 32 MiB.
//
// Prints iterations, mismatches (must be 0: PASS) and a checksum of all B contents (the same with
// and without the shim).
//
// Usage: free_while_busy [--iters N (2000)] [--kernel-ms MS (5)] [--window W (32)]
#include <cstring>
#include <vector>

#include "gpu_common.cuh"

namespace {

__device__ inline std::uint64_t now_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Rewrites p with pattern seed until ns nanoseconds have passed (at least once).
__global__ void long_write(std::uint32_t* p, std::uint64_t n, std::uint32_t seed,
                           std::uint64_t ns) {
  const std::uint64_t start = now_ns();
  do {
    for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n;
         i += std::uint64_t{gridDim.x} * blockDim.x) {
      p[i] = word_at(i, seed);
    }
  } while (now_ns() - start < ns);
}

__global__ void fill(std::uint32_t* p, std::uint64_t n, std::uint32_t seed) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    p[i] = word_at(i, seed);
  }
}

__global__ void verify(const std::uint32_t* p, std::uint64_t n, std::uint32_t seed,
                       unsigned long long* mismatches, unsigned long long* sum) {
  unsigned long long bad = 0, local = 0;
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    const std::uint32_t v = p[i];
    bad += v != word_at(i, seed);
    local += v;
  }
  if (bad) atomicAdd(mismatches, bad);
  atomicAdd(sum, local);
}

struct Pending {
  void* b;
  std::uint64_t words;
  std::uint32_t seed;
  bool async;
  cudaStream_t stream;
};

}  // namespace

int main(int argc, char** argv) {
  int iters = 2000, window = 32;
  double kernel_ms = 5.0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--kernel-ms") && i + 1 < argc)
      kernel_ms = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--window") && i + 1 < argc)
      window = std::atoi(argv[++i]);
  }
  constexpr int kStreams = 4;
  const std::size_t sizes[] = {64u << 10, 2u << 20, 8u << 20, 32u << 20};
  WallClock wall;
  CUDA_CHECK(cudaSetDevice(0));
  cudaStream_t writers[kStreams], fillers[kStreams];
  for (int s = 0; s < kStreams; ++s) {
    const unsigned flags = s % 2 ? cudaStreamNonBlocking : cudaStreamDefault;
    CUDA_CHECK(cudaStreamCreateWithFlags(&writers[s], flags));
    CUDA_CHECK(cudaStreamCreateWithFlags(&fillers[s], flags));
  }
  unsigned long long* counters = nullptr;  // [0] mismatched words, [1] sum of B contents
  CUDA_CHECK(cudaMalloc(&counters, 2 * sizeof(unsigned long long)));
  CUDA_CHECK(cudaMemset(counters, 0, 2 * sizeof(unsigned long long)));
  const std::uint64_t kernel_ns = static_cast<std::uint64_t>(kernel_ms * 1e6);

  std::vector<Pending> pending;
  int done = 0, overlaps = 0;
  bool reported = false;
  auto check_window = [&] {
    CUDA_CHECK(cudaDeviceSynchronize());
    for (const Pending& p : pending) {
      verify<<<256, 256>>>(static_cast<const std::uint32_t*>(p.b), p.words, p.seed, counters,
                           counters + 1);
    }
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    if (done == iters && !reported) {
      // The last window's buffers are live here: the byte accounting's moment.
      std::uint64_t live_bytes = 2 * sizeof(unsigned long long);
      for (const Pending& p : pending) live_bytes += p.words * 4;
      report_bytes(live_bytes);
      reported = true;
    }
    for (const Pending& p : pending) {
      if (p.async) {
        CUDA_CHECK(cudaFreeAsync(p.b, p.stream));
      } else {
        CUDA_CHECK(cudaFree(p.b));
      }
    }
    pending.clear();
  };

  for (int i = 0; i < iters; ++i) {
    const std::size_t size = sizes[i % 4];
    const std::uint64_t words = size / 4;
    const bool async = (i / 4) % 2 == 1;
    cudaStream_t s1 = writers[i % kStreams], s2 = fillers[(i / kStreams) % kStreams];
    const std::uint32_t seed_a = 2 * static_cast<std::uint32_t>(i) + 1;
    const std::uint32_t seed_b = 2 * static_cast<std::uint32_t>(i) + 2;
    void* a = nullptr;
    void* b = nullptr;
    if (async) {
      CUDA_CHECK(cudaMallocAsync(&a, size, s1));
    } else {
      CUDA_CHECK(cudaMalloc(&a, size));
    }
    long_write<<<2, 256, 0, s1>>>(static_cast<std::uint32_t*>(a), words, seed_a, kernel_ns);
    CUDA_CHECK(cudaGetLastError());
    if (async) {
      CUDA_CHECK(cudaFreeAsync(a, s1));
      CUDA_CHECK(cudaMallocAsync(&b, size, s2));
    } else {
      CUDA_CHECK(cudaFree(a));
      CUDA_CHECK(cudaMalloc(&b, size));
    }
    overlaps += a == b;  // reuse itself is fine; only reuse before the writer finished is not
    fill<<<64, 256, 0, s2>>>(static_cast<std::uint32_t*>(b), words, seed_b);
    CUDA_CHECK(cudaGetLastError());
    pending.push_back({b, words, seed_b, async, s2});
    ++done;
    if (static_cast<int>(pending.size()) >= window) check_window();
  }
  check_window();
  unsigned long long result[2];
  CUDA_CHECK(cudaMemcpy(result, counters, sizeof result, cudaMemcpyDeviceToHost));
  const double ms = wall.ms();
  for (int s = 0; s < kStreams; ++s) {
    CUDA_CHECK(cudaStreamDestroy(writers[s]));
    CUDA_CHECK(cudaStreamDestroy(fillers[s]));
  }
  CUDA_CHECK(cudaFree(counters));
  std::printf(
      "%s: free_while_busy (%d iterations, %llu mismatched words, B reused A's address "
      "%d times, kernel %.1f ms)\n",
      result[0] == 0 ? "PASS" : "FAIL", done, result[0], overlaps, kernel_ms);
  std::printf("iterations: %d\nmismatches: %llu\n", done, result[0]);
  std::printf("checksum: %llu\n", result[1]);
  std::printf("wall_ms: %.1f\n", ms);
  return result[0] == 0 ? 0 : 1;
}
