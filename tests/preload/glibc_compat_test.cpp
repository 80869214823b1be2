// The glibc compatibility layer of libgpustitch.so (preload/src/glibc_compat.c), compiled into this
// test as into the library: its forwarders replace the newer glibc symbols here too. The
// equivalents it uses on a glibc older than the function (pthread_cond_clockwait < 2.30,
// _dl_find_object < 2.35) are compared with what the build machine's glibc answers.
#include "glibc_compat.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>

#include <gtest/gtest.h>

extern "C" uint32_t arc4random(void);

namespace {

using Clock = std::chrono::steady_clock;

timespec monotonic_in(std::chrono::nanoseconds d) {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  std::int64_t ns = static_cast<std::int64_t>(now.tv_nsec) + d.count();
  return timespec{now.tv_sec + static_cast<time_t>(ns / 1000000000),
                  static_cast<long>(ns % 1000000000)};
}

TEST(GlibcCompat, ClockwaitFallbackTimesOutOnTheMonotonicDeadline) {
  pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
  pthread_cond_t c = PTHREAD_COND_INITIALIZER;
  pthread_mutex_lock(&m);
  timespec until = monotonic_in(std::chrono::milliseconds(60));
  auto t0 = Clock::now();
  int rc;
  do {  // a spurious wake-up is allowed; the deadline is what counts
    rc = gpustitch_compat_clockwait_fallback(&c, &m, CLOCK_MONOTONIC, &until);
  } while (rc == 0);
  auto waited = Clock::now() - t0;
  pthread_mutex_unlock(&m);
  EXPECT_EQ(rc, ETIMEDOUT);
  EXPECT_GE(waited, std::chrono::milliseconds(55));
  EXPECT_LT(waited, std::chrono::seconds(5));
}

TEST(GlibcCompat, ClockwaitFallbackPastDeadlineAndBadClock) {
  pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
  pthread_cond_t c = PTHREAD_COND_INITIALIZER;
  pthread_mutex_lock(&m);
  timespec past = monotonic_in(-std::chrono::seconds(3));
  auto t0 = Clock::now();
  EXPECT_EQ(gpustitch_compat_clockwait_fallback(&c, &m, CLOCK_MONOTONIC, &past), ETIMEDOUT);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  timespec soon = monotonic_in(std::chrono::milliseconds(10));
  EXPECT_EQ(gpustitch_compat_clockwait_fallback(&c, &m, CLOCK_PROCESS_CPUTIME_ID, &soon), EINVAL);
  pthread_mutex_unlock(&m);
}

TEST(GlibcCompat, ClockwaitFallbackWakesWhenSignalled) {
  pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
  pthread_cond_t c = PTHREAD_COND_INITIALIZER;
  bool ready = false;
  std::thread signaller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    pthread_mutex_lock(&m);
    ready = true;
    pthread_cond_signal(&c);
    pthread_mutex_unlock(&m);
  });
  pthread_mutex_lock(&m);
  timespec until = monotonic_in(std::chrono::seconds(30));
  auto t0 = Clock::now();
  int rc = 0;
  while (!ready && rc == 0) {
    rc = gpustitch_compat_clockwait_fallback(&c, &m, CLOCK_MONOTONIC, &until);
  }
  auto waited = Clock::now() - t0;
  pthread_mutex_unlock(&m);
  signaller.join();
  EXPECT_EQ(rc, 0);
  EXPECT_TRUE(ready);
  EXPECT_LT(waited, std::chrono::seconds(10));
}

// std::condition_variable::wait_for goes through the pthread_cond_clockwait forwarder.
TEST(GlibcCompat, ConditionVariableWaitForThroughTheForwarder) {
  std::mutex m;
  std::condition_variable cv;
  std::unique_lock lock(m);
  auto t0 = Clock::now();
  bool woke = cv.wait_for(lock, std::chrono::milliseconds(30), [] { return false; });
  EXPECT_FALSE(woke);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(30));
}

#ifdef DLFO_STRUCT_HAS_EH_DBASE
// What glibc's own _dl_find_object says, fetched past the forwarder.
int glibc_find_object(void* pc, dl_find_object* out) {
  using Fn = int (*)(void*, dl_find_object*);
  auto fn = reinterpret_cast<Fn>(dlvsym(RTLD_DEFAULT, "_dl_find_object", "GLIBC_2.35"));
  if (!fn) return -2;
  return fn(pc, out);
}

void expect_same_object(void* pc, const char* what) {
  SCOPED_TRACE(what);
  dl_find_object mine{}, theirs{};
  int rc_theirs = glibc_find_object(pc, &theirs);
  if (rc_theirs == -2) GTEST_SKIP() << "this glibc has no _dl_find_object to compare with";
  ASSERT_EQ(rc_theirs, 0);
  ASSERT_EQ(gpustitch_compat_find_object_fallback(pc, &mine), 0);
  EXPECT_NE(mine.dlfo_eh_frame, nullptr);
  EXPECT_EQ(mine.dlfo_eh_frame, theirs.dlfo_eh_frame);
  EXPECT_EQ(mine.dlfo_map_start, theirs.dlfo_map_start);
  auto p = reinterpret_cast<std::uintptr_t>(pc);
  EXPECT_GE(p, reinterpret_cast<std::uintptr_t>(mine.dlfo_map_start));
  EXPECT_LT(p, reinterpret_cast<std::uintptr_t>(mine.dlfo_map_end));
}

TEST(GlibcCompat, FindObjectFallbackAgreesWithGlibc) {
  // This executable, libc and libstdc++ (whatever object defines each address).
  expect_same_object(reinterpret_cast<void*>(&monotonic_in), "test executable");
  expect_same_object(dlsym(RTLD_DEFAULT, "dl_iterate_phdr"), "libc");
  expect_same_object(dlsym(RTLD_DEFAULT, "_ZNSt6thread4joinEv"), "libstdc++ or the executable");
}

TEST(GlibcCompat, FindObjectFallbackFindsNothingOutsideObjects) {
  dl_find_object out{};
  EXPECT_EQ(gpustitch_compat_find_object_fallback(reinterpret_cast<void*>(16), &out), -1);
}
#endif

TEST(GlibcCompat, StatForwardersMatchTheFileSystem) {
  char dir[] = "/tmp/gpustitch-compat-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  std::string file = std::string(dir) + "/f", link = std::string(dir) + "/l";
  int fd = open(file.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "12345", 5), 5);
  ASSERT_EQ(symlink(file.c_str(), link.c_str()), 0);
  struct stat by_path {
  }, by_fd{}, by_link{}, of_link{};
  ASSERT_EQ(stat(file.c_str(), &by_path), 0);
  ASSERT_EQ(fstat(fd, &by_fd), 0);
  ASSERT_EQ(stat(link.c_str(), &by_link), 0);
  ASSERT_EQ(lstat(link.c_str(), &of_link), 0);
  struct stat64 by_fd64 {};
  ASSERT_EQ(fstat64(fd, &by_fd64), 0);
  close(fd);
  EXPECT_EQ(by_path.st_size, 5);
  EXPECT_TRUE(S_ISREG(by_path.st_mode));
  EXPECT_EQ(by_path.st_mode & 0777, 0600u);
  EXPECT_EQ(by_fd.st_ino, by_path.st_ino);
  EXPECT_EQ(by_fd64.st_ino, by_path.st_ino);
  EXPECT_EQ(by_fd64.st_size, 5);
  EXPECT_EQ(by_link.st_ino, by_path.st_ino);
  EXPECT_TRUE(S_ISLNK(of_link.st_mode));
  EXPECT_NE(of_link.st_ino, by_path.st_ino);
  struct stat missing {};
  errno = 0;
  EXPECT_EQ(stat((std::string(dir) + "/none").c_str(), &missing), -1);
  EXPECT_EQ(errno, ENOENT);
  unlink(link.c_str());
  unlink(file.c_str());
  rmdir(dir);
}

TEST(GlibcCompat, Arc4randomDraws) {
  std::set<uint32_t> seen;
  for (int i = 0; i < 16; ++i) seen.insert(arc4random());
  // 16 draws from 2^32 values: a repeat has probability below 1e-7.
  EXPECT_EQ(seen.size(), 16u);
}

// Threads, thread-specific data and once-only initialisation through the pthread forwarders.
TEST(GlibcCompat, PthreadForwarders) {
  static pthread_key_t key;
  static std::atomic<int> once_runs{0};
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  ASSERT_EQ(pthread_key_create(&key, nullptr), 0);
  int mine = 1;
  ASSERT_EQ(pthread_setspecific(key, &mine), 0);
  std::atomic<void*> seen_in_thread{&mine};
  std::thread t([&] {
    seen_in_thread = pthread_getspecific(key);
    pthread_once(&once, [] { once_runs.fetch_add(1); });
  });
  pthread_once(&once, [] { once_runs.fetch_add(1); });
  t.join();
  EXPECT_EQ(seen_in_thread.load(), nullptr);
  EXPECT_EQ(pthread_getspecific(key), &mine);
  EXPECT_EQ(once_runs.load(), 1);
  EXPECT_EQ(pthread_key_delete(key), 0);
}

}  // namespace
