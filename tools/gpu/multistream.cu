// multistream: a plain CUDA C++ program as nvcc builds it by default (static CUDA runtime), using
// four streams. Each stream allocates buffers of mixed sizes (512 B .. 32 MiB, log-uniform), half
// with cudaMalloc and half with cudaMallocAsync on the stream, fills each with a kernel, sums it
// with a second kernel into the stream's accumulator, and frees it (cudaFree or cudaFreeAsync) a
// few allocations later, so frees interleave with other streams' work. The host computes the same
// sums; PASS when the device's checksum equals the host's. The checksum is also printed for
// comparison between a native run and one under LD_PRELOAD=libgpustitch.so.
//
// Usage: multistream [--iters N]   (per stream; default 150)
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "gpu_common.cuh"

namespace {

__global__ void fill(std::uint32_t* p, std::uint64_t n, std::uint32_t seed) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    p[i] = word_at(i, seed);
  }
}

// acc += sum(p[i] * (i + 1)) mod 2^64: reads every word the fill wrote.
__global__ void weighted_sum(const std::uint32_t* p, std::uint64_t n, unsigned long long* acc) {
  unsigned long long local = 0;
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    local += static_cast<unsigned long long>(p[i]) * (i + 1);
  }
  atomicAdd(acc, local);
}

struct Live {
  void* ptr;
  bool async;
  std::size_t size;
};

}  // namespace

int main(int argc, char** argv) {
  int iters = 150;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
  }
  constexpr int kStreams = 4;
  constexpr std::size_t kKeep = 3;  // allocations kept live per stream before freeing the oldest
  WallClock wall;
  CUDA_CHECK(cudaSetDevice(0));
  cudaStream_t streams[kStreams];
  unsigned long long* acc = nullptr;
  CUDA_CHECK(cudaMalloc(&acc, kStreams * sizeof(unsigned long long)));
  CUDA_CHECK(cudaMemset(acc, 0, kStreams * sizeof(unsigned long long)));
  for (auto& s : streams) CUDA_CHECK(cudaStreamCreate(&s));

  // The allocation plan, fixed by the seed; the host's expected sums come from it.
  std::vector<std::vector<std::size_t>> plan(kStreams);
  for (int s = 0; s < kStreams; ++s) {
    Lcg rng(1000 + s);
    for (int i = 0; i < iters; ++i) plan[s].push_back(rng.log_size(512, 32u << 20));
  }

  std::deque<Live> live[kStreams];
  std::uint64_t bytes = 0;
  for (int i = 0; i < iters; ++i) {
    for (int s = 0; s < kStreams; ++s) {
      const std::size_t size = plan[s][i];
      const std::uint64_t words = size / 4;
      const bool async = (i + s) % 2 == 1;
      void* p = nullptr;
      if (async) {
        CUDA_CHECK(cudaMallocAsync(&p, size, streams[s]));
      } else {
        CUDA_CHECK(cudaMalloc(&p, size));
      }
      const std::uint32_t seed = static_cast<std::uint32_t>(s * 100000 + i);
      const unsigned grid = static_cast<unsigned>(std::min<std::uint64_t>(words / 256 + 1, 512));
      fill<<<grid, 256, 0, streams[s]>>>(static_cast<std::uint32_t*>(p), words, seed);
      weighted_sum<<<grid, 256, 0, streams[s]>>>(static_cast<std::uint32_t*>(p), words, acc + s);
      CUDA_CHECK(cudaGetLastError());
      bytes += size;
      live[s].push_back({p, async, size});
      if (live[s].size() > kKeep) {
        Live old = live[s].front();
        live[s].pop_front();
        if (old.async) {
          CUDA_CHECK(cudaFreeAsync(old.ptr, streams[s]));
        } else {
          CUDA_CHECK(cudaFree(old.ptr));
        }
      }
    }
  }
  // The last kKeep allocations of each stream are live here: the byte accounting's moment.
  std::uint64_t live_bytes = kStreams * sizeof(unsigned long long);
  for (const auto& l : live) {
    for (const Live& b : l) live_bytes += b.size;
  }
  report_bytes(live_bytes);
  for (int s = 0; s < kStreams; ++s) {
    for (Live l : live[s]) {
      if (l.async) {
        CUDA_CHECK(cudaFreeAsync(l.ptr, streams[s]));
      } else {
        CUDA_CHECK(cudaFree(l.ptr));
      }
    }
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  unsigned long long got[kStreams];
  CUDA_CHECK(cudaMemcpy(got, acc, sizeof got, cudaMemcpyDeviceToHost));
  const double device_ms = wall.ms();

  // Expected sums, one host thread per stream.
  unsigned long long want[kStreams] = {};
  std::vector<std::thread> threads;
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      unsigned long long sum = 0;
      for (int i = 0; i < iters; ++i) {
        const std::uint32_t seed = static_cast<std::uint32_t>(s * 100000 + i);
        const std::uint64_t words = plan[s][i] / 4;
        for (std::uint64_t w = 0; w < words; ++w) {
          sum += static_cast<unsigned long long>(word_at(w, seed)) * (w + 1);
        }
      }
      want[s] = sum;
    });
  }
  for (auto& t : threads) t.join();

  unsigned long long checksum = 0;
  int bad = 0;
  for (int s = 0; s < kStreams; ++s) {
    checksum = checksum * 1000003ull + got[s];
    if (got[s] != want[s]) {
      ++bad;
      std::printf("stream %d: device sum %llu, expected %llu\n", s, got[s], want[s]);
    }
  }
  for (auto& s : streams) CUDA_CHECK(cudaStreamDestroy(s));
  CUDA_CHECK(cudaFree(acc));
  std::printf(
      "%s: multistream (%d streams x %d allocations, %.1f MiB allocated in total, "
      "%d stream sums wrong)\n",
      bad == 0 ? "PASS" : "FAIL", kStreams, iters, bytes / 1048576.0, bad);
  std::printf("checksum: %llu\n", checksum);
  std::printf("wall_ms: %.1f\n", device_ms);
  return bad == 0 ? 0 : 1;
}
