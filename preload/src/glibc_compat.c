/* glibc_compat.c: keeps libgpustitch.so loadable on glibc 2.28 (manylinux_2_28, RHEL 8) although it
 * is built against a newer glibc.
 *
 * The library goes into other people's processes, often inside containers whose glibc is older
 * than the build machine's. A preloaded library with one unmet symbol version stops the program
 * before main (the dynamic loader refuses it), so every symbol it takes from glibc must exist at
 * GLIBC_2.28 or older. Linking against the build glibc picks the newest version of each symbol,
 * and the statically linked libstdc++ and libgcc unwinder (preload/CMakeLists.txt) bring
 * references of their own. This file defines, inside the library, each glibc symbol that would
 * otherwise be taken at a newer version. Local definitions win over the shared libc at link time,
 * for the library's own objects and the static C++ runtime alike, so no caller changes:
 *  - symbols that moved into libc.so.6 in 2.32-2.34 (pthread, dl*, shm_*) and stat, which was a
 *    header inline over __xstat before 2.33: a one-instruction jump (this file is built -fno-plt)
 *    to the oldest version, exactly what the PLT did before, so the hot path pays nothing;
 *  - symbols that 2.28 does not have (pthread_cond_clockwait 2.30, _dl_find_object 2.35,
 *    arc4random 2.36): the real one when the running glibc has it, looked up once, else an
 *    equivalent built from 2.28's functions;
 *  - __libc_single_threaded (2.32), a variable libstdc++ reads to skip atomic reference counts:
 *    a local one that always says "threads may exist", which is what a CUDA process is anyway.
 * The old versions live in libpthread.so.0, libdl.so.2 and librt.so.1 before 2.34, so the library
 * lists those as NEEDED (stubs on newer glibc). tests/preload checks the resulting symbol table
 * (check_library.cmake, CHECK=glibc) and runs the library in a Debian bullseye root. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "glibc_compat.h"

/* The oldest version of each symbol, per architecture (the first version glibc had there). */
#if defined(__x86_64__)
#define GS_BASE "GLIBC_2.2.5"
#define GS_SETNAME "GLIBC_2.12"
#define GS_STAT_VER 1 /* _STAT_VER_LINUX: the kernel's struct stat */
#elif defined(__aarch64__)
#define GS_BASE "GLIBC_2.17"
#define GS_SETNAME "GLIBC_2.17"
#define GS_STAT_VER 0
#else
#error "glibc_compat.c: add this architecture's oldest glibc symbol versions"
#endif

#define GS_LOCAL __attribute__((visibility("hidden")))
/* Declares gs_old_NAME as a reference to NAME@VERSION. */
#define GS_OLD(name, version) __asm__(".symver gs_old_" #name "," #name "@" version)

/* ---- Moved into libc.so.6 in glibc 2.32-2.34: jump to the pre-move version. ---- */

extern int gs_old_pthread_create(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
GS_OLD(pthread_create, GS_BASE);
GS_LOCAL int pthread_create(pthread_t* t, const pthread_attr_t* attr, void* (*fn)(void*),
                            void* arg) {
  return gs_old_pthread_create(t, attr, fn, arg);
}

extern int gs_old_pthread_detach(pthread_t);
GS_OLD(pthread_detach, GS_BASE);
GS_LOCAL int pthread_detach(pthread_t t) {
  return gs_old_pthread_detach(t);
}

extern int gs_old_pthread_join(pthread_t, void**);
GS_OLD(pthread_join, GS_BASE);
GS_LOCAL int pthread_join(pthread_t t, void** ret) {
  return gs_old_pthread_join(t, ret);
}

extern void* gs_old_pthread_getspecific(pthread_key_t);
GS_OLD(pthread_getspecific, GS_BASE);
GS_LOCAL void* pthread_getspecific(pthread_key_t key) {
  return gs_old_pthread_getspecific(key);
}

/* access none: glibc's own declaration says the value is stored, never read. */
extern int gs_old_pthread_setspecific(pthread_key_t, const void*) __attribute__((access(none, 2)));
GS_OLD(pthread_setspecific, GS_BASE);
GS_LOCAL int pthread_setspecific(pthread_key_t key, const void* value) {
  return gs_old_pthread_setspecific(key, value);
}

extern int gs_old_pthread_key_create(pthread_key_t*, void (*)(void*));
GS_OLD(pthread_key_create, GS_BASE);
GS_LOCAL int pthread_key_create(pthread_key_t* key, void (*dtor)(void*)) {
  return gs_old_pthread_key_create(key, dtor);
}

/* libstdc++'s gthr-posix.h refers to the internal name too. */
int __pthread_key_create(pthread_key_t*, void (*)(void*));
extern int gs_old___pthread_key_create(pthread_key_t*, void (*)(void*));
GS_OLD(__pthread_key_create, GS_BASE);
GS_LOCAL int __pthread_key_create(pthread_key_t* key, void (*dtor)(void*)) {
  return gs_old___pthread_key_create(key, dtor);
}

extern int gs_old_pthread_key_delete(pthread_key_t);
GS_OLD(pthread_key_delete, GS_BASE);
GS_LOCAL int pthread_key_delete(pthread_key_t key) {
  return gs_old_pthread_key_delete(key);
}

extern int gs_old_pthread_once(pthread_once_t*, void (*)(void));
GS_OLD(pthread_once, GS_BASE);
GS_LOCAL int pthread_once(pthread_once_t* once, void (*fn)(void)) {
  return gs_old_pthread_once(once, fn);
}

extern int gs_old_pthread_rwlock_rdlock(pthread_rwlock_t*);
GS_OLD(pthread_rwlock_rdlock, GS_BASE);
GS_LOCAL int pthread_rwlock_rdlock(pthread_rwlock_t* l) {
  return gs_old_pthread_rwlock_rdlock(l);
}

extern int gs_old_pthread_rwlock_wrlock(pthread_rwlock_t*);
GS_OLD(pthread_rwlock_wrlock, GS_BASE);
GS_LOCAL int pthread_rwlock_wrlock(pthread_rwlock_t* l) {
  return gs_old_pthread_rwlock_wrlock(l);
}

extern int gs_old_pthread_rwlock_unlock(pthread_rwlock_t*);
GS_OLD(pthread_rwlock_unlock, GS_BASE);
GS_LOCAL int pthread_rwlock_unlock(pthread_rwlock_t* l) {
  return gs_old_pthread_rwlock_unlock(l);
}

extern int gs_old_pthread_setname_np(pthread_t, const char*);
GS_OLD(pthread_setname_np, GS_SETNAME);
GS_LOCAL int pthread_setname_np(pthread_t t, const char* name) {
  return gs_old_pthread_setname_np(t, name);
}

extern int gs_old_pthread_sigmask(int, const sigset_t*, sigset_t*);
GS_OLD(pthread_sigmask, GS_BASE);
GS_LOCAL int pthread_sigmask(int how, const sigset_t* set, sigset_t* old) {
  return gs_old_pthread_sigmask(how, set, old);
}

extern void* gs_old_dlopen(const char*, int);
GS_OLD(dlopen, GS_BASE);
/* A jump, not a call: the loader reads the return address to know who asked (search paths). */
GS_LOCAL void* dlopen(const char* file, int mode) {
  return gs_old_dlopen(file, mode);
}

extern void* gs_old_dlvsym(void*, const char*, const char*);
GS_OLD(dlvsym, GS_BASE);
GS_LOCAL void* dlvsym(void* handle, const char* name, const char* version) {
  return gs_old_dlvsym(handle, name, version);
}

extern int gs_old_dladdr(const void*, Dl_info*);
GS_OLD(dladdr, GS_BASE);
GS_LOCAL int dladdr(const void* addr, Dl_info* info) {
  return gs_old_dladdr(addr, info);
}

extern int gs_old_shm_open(const char*, int, mode_t);
GS_OLD(shm_open, GS_BASE);
GS_LOCAL int shm_open(const char* name, int flags, mode_t mode) {
  return gs_old_shm_open(name, flags, mode);
}

extern int gs_old_shm_unlink(const char*);
GS_OLD(shm_unlink, GS_BASE);
GS_LOCAL int shm_unlink(const char* name) {
  return gs_old_shm_unlink(name);
}

/* stat and friends became functions in 2.33; before, the headers called __xstat and friends. */
extern int gs_old___xstat(int, const char*, struct stat*);
GS_OLD(__xstat, GS_BASE);
extern int gs_old___lxstat(int, const char*, struct stat*);
GS_OLD(__lxstat, GS_BASE);
extern int gs_old___fxstat(int, int, struct stat*);
GS_OLD(__fxstat, GS_BASE);
extern int gs_old___fxstat64(int, int, struct stat64*);
GS_OLD(__fxstat64, GS_BASE);

GS_LOCAL int stat(const char* restrict path, struct stat* restrict buf) {
  return gs_old___xstat(GS_STAT_VER, path, buf);
}
GS_LOCAL int lstat(const char* restrict path, struct stat* restrict buf) {
  return gs_old___lxstat(GS_STAT_VER, path, buf);
}
GS_LOCAL int fstat(int fd, struct stat* buf) {
  return gs_old___fxstat(GS_STAT_VER, fd, buf);
}
GS_LOCAL int fstat64(int fd, struct stat64* buf) {
  return gs_old___fxstat64(GS_STAT_VER, fd, buf);
}

/* ---- libstdc++'s single-threaded hint (2.32). ---- */

/* 0: "other threads may exist", so libstdc++ always takes the atomic path, which is correct in
 * every process (the hint only ever lets it skip atomics). */
GS_LOCAL char __libc_single_threaded = 0;

/* ---- Not in 2.28: the running glibc's when it has one, else an equivalent. ---- */

typedef int (*ClockwaitFn)(pthread_cond_t*, pthread_mutex_t*, clockid_t, const struct timespec*);

/* Looked up once (the lookup is idempotent, so a race only repeats it). (void*)-1: none. */
static void* resolve_once(void** slot, const char* name, const char* v1, const char* v2) {
  void* fn = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  if (fn) return fn == (void*)-1 ? NULL : fn;
  fn = dlvsym(RTLD_DEFAULT, name, v1);
  if (!fn && v2) fn = dlvsym(RTLD_DEFAULT, name, v2);
  __atomic_store_n(slot, fn ? fn : (void*)-1, __ATOMIC_RELEASE);
  return fn;
}

GS_LOCAL int gpustitch_compat_clockwait_fallback(pthread_cond_t* restrict cond,
                                                 pthread_mutex_t* restrict mutex, clockid_t clock,
                                                 const struct timespec* restrict abstime) {
  if (clock != CLOCK_REALTIME && clock != CLOCK_MONOTONIC) return EINVAL;
  if (clock == CLOCK_REALTIME) return pthread_cond_timedwait(cond, mutex, abstime);
  /* A steady-clock deadline as a wall-clock one (what libstdc++ itself did before 2.30): a wall
   * clock step during the wait lengthens or shortens it, and callers (condition_variable's
   * wait_until with steady_clock) re-check the time and wait again. */
  struct timespec mono, real;
  clock_gettime(CLOCK_MONOTONIC, &mono);
  clock_gettime(CLOCK_REALTIME, &real);
  int64_t left_ns =
      (int64_t)(abstime->tv_sec - mono.tv_sec) * 1000000000 + (abstime->tv_nsec - mono.tv_nsec);
  if (left_ns < 0) left_ns = 0;
  int64_t deadline_ns = (int64_t)real.tv_nsec + left_ns % 1000000000;
  struct timespec until = {real.tv_sec + (time_t)(left_ns / 1000000000) + deadline_ns / 1000000000,
                           (long)(deadline_ns % 1000000000)};
  return pthread_cond_timedwait(cond, mutex, &until);
}

GS_LOCAL int pthread_cond_clockwait(pthread_cond_t* restrict cond, pthread_mutex_t* restrict mutex,
                                    clockid_t clock, const struct timespec* restrict abstime) {
  static void* real;
  ClockwaitFn fn =
      (ClockwaitFn)resolve_once(&real, "pthread_cond_clockwait", "GLIBC_2.34", "GLIBC_2.30");
  if (fn) return fn(cond, mutex, clock, abstime);
  return gpustitch_compat_clockwait_fallback(cond, mutex, clock, abstime);
}

/* std::random_device (libstdc++'s random.o) uses arc4random when the build glibc had it. */
GS_LOCAL uint32_t arc4random(void) {
  uint32_t v;
  /* getentropy (2.25) fills up to 256 bytes from the kernel's CSPRNG and only fails where the
   * getrandom system call is missing (kernel < 3.17); /dev/urandom then. */
  if (getentropy(&v, sizeof v) == 0) return v;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ssize_t n = read(fd, &v, sizeof v);
    close(fd);
    if (n == (ssize_t)sizeof v) return v;
  }
  abort(); /* as glibc's arc4random does when no randomness can be had */
}

#ifdef DLFO_STRUCT_HAS_EH_DBASE
#if DLFO_STRUCT_HAS_EH_DBASE
#error "glibc_compat.c: this architecture's unwinder also needs dlfo_eh_dbase"
#endif
/* The static unwinder (libgcc_eh, unwind-dw2-fde-dip.c) finds a frame's unwind tables with
 * _dl_find_object when the build glibc had it. Before 2.35 it walked dl_iterate_phdr, which is
 * what the fallback does: the object whose loaded segments contain pc, and its PT_GNU_EH_FRAME. */
struct dlfo_search {
  uintptr_t pc;
  struct dl_find_object* out;
};

static int dlfo_visit(struct dl_phdr_info* info, size_t size, void* data) {
  (void)size;
  struct dlfo_search* s = data;
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  void* eh_frame = NULL;
  int hit = 0;
  for (ElfW(Half) i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)* p = &info->dlpi_phdr[i];
    uintptr_t begin = info->dlpi_addr + p->p_vaddr;
    if (p->p_type == PT_LOAD) {
      uintptr_t end = begin + p->p_memsz;
      if (begin < lo) lo = begin;
      if (end > hi) hi = end;
      if (s->pc >= begin && s->pc < end) hit = 1;
    } else if (p->p_type == PT_GNU_EH_FRAME) {
      eh_frame = (void*)begin;
    }
  }
  if (!hit) return 0;
  memset(s->out, 0, sizeof *s->out);
  s->out->dlfo_map_start = (void*)lo;
  s->out->dlfo_map_end = (void*)hi;
  s->out->dlfo_eh_frame = eh_frame;
  return 1;
}

GS_LOCAL int gpustitch_compat_find_object_fallback(void* pc, struct dl_find_object* out) {
  struct dlfo_search s = {(uintptr_t)pc, out};
  return dl_iterate_phdr(dlfo_visit, &s) ? 0 : -1;
}

typedef int (*FindObjectFn)(void*, struct dl_find_object*);

GS_LOCAL int _dl_find_object(void* pc, struct dl_find_object* out) {
  static void* real;
  FindObjectFn fn = (FindObjectFn)resolve_once(&real, "_dl_find_object", "GLIBC_2.35", NULL);
  if (fn) return fn(pc, out);
  return gpustitch_compat_find_object_fallback(pc, out);
}
#endif
