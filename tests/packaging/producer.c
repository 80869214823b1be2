/* A CUDA program for the end-to-end test, built against the CUDA runtime test double
 * (tests/preload/doubles: libcudart.so.13 and libcuda.so.1 on host memory), the way a real program
 * is built against libcudart. Run under LD_PRELOAD=libgpustitch.so, its cudaMalloc/cudaFree calls
 * reach the shim first, which serves them from the pool on the simulated backend.
 *
 * Run with GPUSTITCH_CONF=backend:sim,sim_capacity_mb:64. On that 64 MiB device it allocates
 * 16 x 4 MiB (the device is full), frees every other one (32 MiB free, in 4 MiB pieces), allocates
 * 16 MiB (possible only by stitching four pieces) and then 64 MiB (must fail: out of memory). It
 * prints READY, keeps 8 x 4 MiB + 16 MiB = 48 MiB allocated until stdin closes, frees everything
 * and exits 0. Any unexpected result is printed on stderr with exit status 1. */
#include <stdio.h>
#include <string.h>

int cudaMalloc(void** ptr, size_t size);
int cudaFree(void* ptr);

#define MiB ((size_t)1 << 20)

int main(void) {
  void* blocks[16] = {0};
  for (int i = 0; i < 16; ++i) {
    int rc = cudaMalloc(&blocks[i], 4 * MiB);
    if (rc != 0) {
      fprintf(stderr, "producer: cudaMalloc(4 MiB) #%d failed: %d\n", i, rc);
      return 1;
    }
  }
  for (int i = 0; i < 16; i += 2) {
    if (cudaFree(blocks[i]) != 0) {
      fprintf(stderr, "producer: cudaFree failed\n");
      return 1;
    }
    blocks[i] = NULL;
  }
  void* stitched = NULL;
  int rc = cudaMalloc(&stitched, 16 * MiB);
  if (rc != 0) {
    fprintf(stderr, "producer: cudaMalloc(16 MiB) over scattered free memory failed: %d\n", rc);
    return 1;
  }
  void* too_big = NULL;
  rc = cudaMalloc(&too_big, 64 * MiB);
  if (rc == 0) {
    fprintf(stderr, "producer: cudaMalloc(64 MiB) on a full 64 MiB device succeeded\n");
    return 1;
  }
  printf("READY\n");
  fflush(stdout);
  char buf[256];
  while (fgets(buf, sizeof buf, stdin)) {
  }
  for (int i = 0; i < 16; ++i)
    if (blocks[i] && cudaFree(blocks[i]) != 0) return 1;
  return cudaFree(stitched) == 0 ? 0 : 1;
}
