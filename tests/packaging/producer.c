/* A stand-in for a CUDA program: it finds cudaMalloc/cudaFree with dlsym, so it runs only when a
 * library in LD_PRELOAD (libgpustitch.so) provides them, and links no CUDA library itself.
 *
 * Run with GPUSTITCH_CONF=backend:sim,sim_capacity_mb:64. On that 64 MiB device it allocates
 * 16 x 4 MiB (the device is full), frees every other one (32 MiB free, in 4 MiB pieces), allocates
 * 16 MiB (possible only by stitching four pieces) and then 64 MiB (must fail: out of memory). It
 * prints READY, keeps 8 x 4 MiB + 16 MiB = 48 MiB allocated until stdin closes, frees everything
 * and exits 0. Any unexpected result is printed on stderr with exit status 1. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int (*malloc_fn)(void**, size_t);
typedef int (*free_fn)(void*);

#define MiB ((size_t)1 << 20)

int main(void) {
  malloc_fn cuda_malloc = (malloc_fn)dlsym(RTLD_DEFAULT, "cudaMalloc");
  free_fn cuda_free = (free_fn)dlsym(RTLD_DEFAULT, "cudaFree");
  if (!cuda_malloc || !cuda_free) {
    fprintf(stderr,
            "producer: cudaMalloc/cudaFree not found: run with LD_PRELOAD=libgpustitch.so\n");
    return 1;
  }
  void* blocks[16] = {0};
  for (int i = 0; i < 16; ++i) {
    int rc = cuda_malloc(&blocks[i], 4 * MiB);
    if (rc != 0) {
      fprintf(stderr, "producer: cudaMalloc(4 MiB) #%d failed: %d\n", i, rc);
      return 1;
    }
  }
  for (int i = 0; i < 16; i += 2) {
    if (cuda_free(blocks[i]) != 0) {
      fprintf(stderr, "producer: cudaFree failed\n");
      return 1;
    }
    blocks[i] = NULL;
  }
  void* stitched = NULL;
  int rc = cuda_malloc(&stitched, 16 * MiB);
  if (rc != 0) {
    fprintf(stderr, "producer: cudaMalloc(16 MiB) over scattered free memory failed: %d\n", rc);
    return 1;
  }
  void* too_big = NULL;
  rc = cuda_malloc(&too_big, 64 * MiB);
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
    if (blocks[i] && cuda_free(blocks[i]) != 0) return 1;
  return cuda_free(stitched) == 0 ? 0 : 1;
}
