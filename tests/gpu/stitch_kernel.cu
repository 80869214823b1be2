// A kernel writes through a range the pool stitched, and the host reads every byte back.
//
// The pool runs on the CUDA backend with a cap, so that fresh physical memory is refused: it is
// filled with 64 MiB blocks up to the cap, every other block is freed (scattered 64 MiB holes,
// none adjacent), and a block larger than any hole is requested. The pool can only serve it by
// stitching free handles side by side into a new address range (stats: stitches goes up). Then:
//  1. a kernel fills the whole stitched block with a position-dependent pattern, the host copies
//     it back and checks every word;
//  2. a kernel writes a second pattern into a window straddling the seam between two pieces, and
//     the host checks the window and that the bytes around it are untouched;
//  3. the live 64 MiB neighbours, written before the stitch, still hold their own pattern.
// Prints PASS/FAIL lines; exit status 0 only if every check passed.
#include <cuda_runtime.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpustitch/cuda_backend.h"
#include "gpustitch/pool.h"

using namespace gpustitch;

namespace {

__host__ __device__ inline std::uint32_t word_at(std::uint64_t i, std::uint32_t seed) {
  std::uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<std::uint32_t>(x);
}

__global__ void fill(std::uint32_t* p, std::uint64_t first, std::uint64_t n, std::uint32_t seed) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    p[i] = word_at(first + i, seed);
  }
}

int failures = 0;

void check(bool ok, const char* what, const std::string& detail = {}) {
  std::printf("%s: %s%s%s\n", ok ? "PASS" : "FAIL", what, detail.empty() ? "" : " -- ",
              detail.c_str());
  if (!ok) ++failures;
}

bool cuda_ok(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return true;
  std::printf("FAIL: %s: %s\n", call, cudaGetErrorString(e));
  ++failures;
  return false;
}

void launch_fill(DevPtr p, std::uint64_t first_word, std::uint64_t words, std::uint32_t seed) {
  fill<<<1024, 256>>>(reinterpret_cast<std::uint32_t*>(p), first_word, words, seed);
  cuda_ok(cudaGetLastError(), "kernel launch");
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

// Copies [p, p+bytes) back and counts words differing from word_at(first_word + i, seed).
std::uint64_t mismatches(DevPtr p, std::uint64_t first_word, std::uint64_t bytes,
                         std::uint32_t seed) {
  std::vector<std::uint32_t> host(bytes / 4);
  if (!cuda_ok(cudaMemcpy(host.data(), reinterpret_cast<void*>(p), bytes, cudaMemcpyDeviceToHost),
               "cudaMemcpy")) {
    return bytes / 4;
  }
  std::uint64_t bad = 0;
  for (std::uint64_t i = 0; i < host.size(); ++i) bad += host[i] != word_at(first_word + i, seed);
  return bad;
}

}  // namespace

int main() {
  if (!cuda_ok(cudaSetDevice(0), "cudaSetDevice")) return 1;
  std::string why;
  auto backend = make_cuda_backend(&why);
  if (!backend) {
    std::printf("FAIL: CUDA backend: %s\n", why.c_str());
    return 1;
  }
  std::printf("backend: %s, granularity %zu KiB, map offset %s\n", backend->name(),
              backend->granularity(0) / 1024, backend->supports_map_offset(0) ? "yes" : "no");

  constexpr std::size_t kBlock = 64 * MiB;
  constexpr int kBlocks = 32;  // 2 GiB under the cap
  Config config;
  config.cap = kBlocks * kBlock;
  config.release_threshold = SIZE_MAX;
  config.stitching = true;
  Pool pool(*backend, config);

  std::vector<DevPtr> blocks;
  for (int i = 0; i < kBlocks + 4; ++i) {
    DevPtr p = 0;
    if (pool.allocate(0, kBlock, kAnyStream, &p) != Status::ok) break;
    blocks.push_back(p);
  }
  check(blocks.size() >= 8 && blocks.size() <= kBlocks, "the cap bounds fresh allocations",
        std::to_string(blocks.size()) + " blocks of 64 MiB under a 2 GiB cap");
  if (blocks.size() < 8) return 1;

  // Every block gets its own pattern; the odd ones are then freed.
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    launch_fill(blocks[i], 0, kBlock / 4, 100 + static_cast<std::uint32_t>(i));
  }
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    check(pool.deallocate(blocks[i]) == Status::ok, "free a 64 MiB block");
    blocks[i] = 0;
  }
  pool.drain_pending(0);

  const DeviceStats before = pool.stats(0);
  const std::size_t holes = blocks.size() / 2;
  const std::size_t big = (holes >= 4 ? 4 : holes) * kBlock;  // larger than any 64 MiB hole
  DevPtr stitched = 0;
  const Status st = pool.allocate(0, big, kAnyStream, &stitched);
  const DeviceStats after = pool.stats(0);
  check(st == Status::ok, "allocate a block larger than any free hole",
        std::to_string(big / MiB) + " MiB: " + to_string(st));
  check(after.stitches > before.stitches, "the pool served it by stitching",
        "stitches " + std::to_string(before.stitches) + " -> " + std::to_string(after.stitches) +
            ", fresh " + std::to_string(before.fresh) + " -> " + std::to_string(after.fresh));
  if (st != Status::ok) return 1;
  BlockInfo info;
  check(pool.find(stitched + big - 1, &info) && info.base == stitched,
        "find() knows the stitched block");

  // 1. The whole stitched block.
  launch_fill(stitched, 0, big / 4, 7);
  std::uint64_t bad = mismatches(stitched, 0, big, 7);
  check(bad == 0, "kernel pattern through the whole stitched block reads back",
        std::to_string(bad) + " of " + std::to_string(big / 4) + " words differ");

  // 2. A window straddling the seam between the first two pieces.
  const std::uint64_t seam = kBlock, window = 1 * MiB;
  launch_fill(stitched + seam - window / 2, 0, window / 4, 8);
  bad = mismatches(stitched + seam - window / 2, 0, window, 8);
  check(bad == 0, "kernel writes across the seam of two pieces",
        std::to_string(bad) + " words differ in the 1 MiB window");
  bad =
      mismatches(stitched, 0, seam - window / 2, 7) +
      mismatches(stitched + seam + window / 2, (seam + window / 2) / 4, big - seam - window / 2, 7);
  check(bad == 0, "bytes outside the window are untouched", std::to_string(bad) + " words differ");

  // 3. Live neighbours keep their own bytes.
  bad = 0;
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    bad += mismatches(blocks[i], 0, kBlock, 100 + static_cast<std::uint32_t>(i));
  }
  check(bad == 0, "live blocks keep their bytes across the stitch", std::to_string(bad) + " words");

  check(pool.deallocate(stitched) == Status::ok, "free the stitched block");
  for (DevPtr p : blocks) {
    if (p != 0) pool.deallocate(p);
  }
  pool.drain_pending(0);
  const DeviceStats end = pool.stats(0);
  check(end.live_blocks == 0, "no live blocks at the end");
  const std::size_t trimmed = pool.trim(0);
  std::printf("trimmed %zu MiB; stitches %" PRIu64 ", stitched %" PRIu64 " MiB\n", trimmed / MiB,
              end.stitches, end.stitched_bytes / MiB);
  std::printf("%s: stitch_kernel (%d failure%s)\n", failures == 0 ? "PASS" : "FAIL", failures,
              failures == 1 ? "" : "s");
  return failures == 0 ? 0 : 1;
}
