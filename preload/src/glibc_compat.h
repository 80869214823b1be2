/* glibc_compat.h: the equivalents glibc_compat.c uses where the running glibc lacks a function,
 * declared for the test that compares them with glibc's own (tests/preload/glibc_compat_test.cpp).
 * They are local to libgpustitch.so. */
#ifndef GPUSTITCH_PRELOAD_GLIBC_COMPAT_H_
#define GPUSTITCH_PRELOAD_GLIBC_COMPAT_H_

#include <dlfcn.h>
#include <pthread.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/* pthread_cond_clockwait for glibc < 2.30: CLOCK_MONOTONIC deadlines through
 * pthread_cond_timedwait. */
int gpustitch_compat_clockwait_fallback(pthread_cond_t* cond, pthread_mutex_t* mutex,
                                        clockid_t clock, const struct timespec* abstime);

#ifdef DLFO_STRUCT_HAS_EH_DBASE
/* _dl_find_object for glibc < 2.35, from dl_iterate_phdr (dlfo_link_map is left null). */
int gpustitch_compat_find_object_fallback(void* pc, struct dl_find_object* out);
#endif

#ifdef __cplusplus
}
#endif

#endif /* GPUSTITCH_PRELOAD_GLIBC_COMPAT_H_ */
