// TraceWriter: RMM-format CSV trace of every allocation and free, buffered off the hot path.
//
// Hot path. on_allocate/on_free take a timestamp (vDSO clock_gettime), the cached thread id and
// claim a slot of a bounded multi-producer ring (Vyukov's sequence-numbered array queue: one CAS
// on the tail, a store to publish). Nothing is formatted and no lock is taken there.
//
// Drain path. One drainer at a time (a try-lock flag) walks the ring from the head while slots
// are published, formats each record into a preallocated buffer with hand-written integer
// formatting and write()s whole lines. It uses no heap, no stdio, no locale and no lock that a
// signal could interrupt, so the same function serves:
//   - the writer thread (every flush_interval_ms; it runs with all signals blocked),
//   - a producer that finds the ring full (it drains instead of dropping or sleeping),
//   - an atexit hook (normal exit, including Python's sys.exit),
//   - a SIGTERM handler, which drains every registered writer with a bounded wait for the lock
//     and then hands the signal to whatever handler was installed before (default action:
//     restore it and re-raise, so the exit status still says "killed by SIGTERM").
// A record whose producer was interrupted between claiming and publishing its slot ends the
// drain: the file is complete up to the last published record and every line in it is whole.
//
// Failures. open() failing or write() failing (ENOSPC, EDQUOT, EIO, ...) is reported once on
// stderr with the path and reason; the writer then stops recording and the program continues.
//
// Never blocking the host program. The writer is created inside the program's first CUDA call,
// under the library's init lock, and its file is written from allocating threads when the ring
// is full, so anything that can block for good there blocks the program. Hence:
//   - only a regular file is traced: the path is opened with O_NONBLOCK and O_NOCTTY (a FIFO
//     without a reader fails at once with ENXIO instead of waiting for one; a terminal does not
//     become the controlling terminal) and anything that is not a regular file (FIFO, socket,
//     device) is refused, since a reader that stops reading would block every write;
//   - a producer that finds the ring full waits for the drain lock only while the drainer
//     holding it makes progress. When no batch has been written for kProducerStallNs (a write
//     stuck on a hung file system), the producer drops its record and counts it, and later
//     producers drop at once until a drain completes. The bound is on progress, not on the wait:
//     a drainer that is merely descheduled (a loaded machine, more producers than cores) comes
//     back well within it, and dropping records then would make traces incomplete for no reason.
//     Dropped records are reported once, with their count, at close or exit.
//
// Times are local wall-clock time of day like RMM's ("%H:%M:%S.%f"); the UTC offset is taken
// once when the writer opens, so the drain path never calls into the time-zone code.
#include "gpustitch/trace/trace_writer.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

namespace gpustitch::trace {

namespace {

constexpr std::uint8_t kActionAllocate = 0;
constexpr std::uint8_t kActionFree = 1;
constexpr std::uint8_t kNoServedBy = 0xff;
// Our own "error" for a path that is not a regular file (no errno says exactly that).
constexpr int kNotRegularFile = -1;
// How long a producer that finds the ring full waits for another drainer that writes nothing
// (see the header).
constexpr std::uint64_t kProducerStallNs = 100'000'000;

struct Record {
  std::uint64_t time_ns;
  std::uint64_t ptr;
  std::uint64_t size;
  std::uint64_t stream;
  std::uint32_t tid;
  std::int16_t device;
  std::uint8_t action;
  std::uint8_t served;
};

struct Slot {
  std::atomic<std::uint64_t> seq;
  Record rec;
};

std::uint64_t now_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

std::uint64_t monotonic_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

std::uint32_t thread_id() noexcept {
  static thread_local std::uint32_t tid = 0;
  if (tid == 0) tid = static_cast<std::uint32_t>(syscall(SYS_gettid));
  return tid;
}

// --- async-signal-safe formatting ------------------------------------------------------------
char* put_str(char* p, const char* s) noexcept {
  while (*s) *p++ = *s++;
  return p;
}

char* put_dec(char* p, std::uint64_t v) noexcept {
  char tmp[24];
  int n = 0;
  do {
    tmp[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v);
  while (n) *p++ = tmp[--n];
  return p;
}

char* put_dec_fixed(char* p, std::uint64_t v, int width) noexcept {
  for (int i = width - 1; i >= 0; --i) {
    p[i] = static_cast<char>('0' + v % 10);
    v /= 10;
  }
  return p + width;
}

char* put_hex(char* p, std::uint64_t v) noexcept {
  static constexpr char kDigits[] = "0123456789abcdef";
  *p++ = '0';
  *p++ = 'x';
  char tmp[16];
  int n = 0;
  do {
    tmp[n++] = kDigits[v & 15];
    v >>= 4;
  } while (v);
  while (n) *p++ = tmp[--n];
  return p;
}

const char* served_by_name(std::uint8_t s) noexcept {
  return to_string(static_cast<ServedBy>(s));  // "unknown" for values outside the enum
}

const char* errno_text(int e) noexcept {
  switch (e) {
    case ENOSPC:
      return "No space left on device";
    case EDQUOT:
      return "Disk quota exceeded";
    case EACCES:
      return "Permission denied";
    case EPERM:
      return "Operation not permitted";
    case ENOENT:
      return "No such file or directory";
    case EROFS:
      return "Read-only file system";
    case EIO:
      return "Input/output error";
    case EFBIG:
      return "File too large";
    case EISDIR:
      return "Is a directory";
    case ENOTDIR:
      return "Not a directory";
    case EBADF:
      return "Bad file descriptor";
    case ENXIO:
      return "a FIFO without a reader";
    case kNotRegularFile:
      return "not a regular file (a FIFO, socket or device could block the program)";
    default:
      return nullptr;
  }
}

void write_all_stderr(const char* s, std::size_t n) noexcept {
  while (n > 0) {
    ssize_t w = ::write(2, s, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    s += w;
    n -= static_cast<std::size_t>(w);
  }
}

// --- process-wide registry (signal handler, atexit, fork) ------------------------------------
constexpr int kMaxWriters = 8;
std::atomic<TraceWriter*> g_writers[kMaxWriters];
std::atomic<bool> g_hooks_installed{false};
std::atomic<bool> g_sigterm_installed{false};
struct sigaction g_previous_sigterm;

void flush_all_for_signal() noexcept;
void sigterm_handler(int sig, siginfo_t* info, void* context);

}  // namespace

struct TraceWriter::Impl {
  TraceWriter* owner = nullptr;
  int fd = -1;
  std::size_t mask = 0;
  Slot* slots = nullptr;
  alignas(64) std::atomic<std::uint64_t> tail{0};
  alignas(64) std::uint64_t head = 0;  // touched only by the drainer holding drain_lock
  std::atomic<bool> drain_lock{false};
  std::atomic<bool> stalled{false};       // a producer gave up waiting for the drain lock
  std::atomic<std::uint64_t> batches{0};  // batches drained so far: the drainer's progress
  char* buf = nullptr;
  std::uint64_t committed = 0;  // file size after the last fully written batch
  static constexpr std::size_t kBufSize = 1 << 16;
  static constexpr std::size_t kMaxLine = 160;
  long utc_offset_s = 0;
  pthread_t thread{};
  bool thread_running = false;
  std::atomic<bool> thread_started{false};  // set by the thread once it runs thread_main
  std::atomic<bool> stop{false};
  std::atomic<bool> in_child{false};
  std::atomic<bool> dropped_reported{false};

  // Takes the drain lock. bounded: give up after about 200 ms (signal handlers, exit).
  bool lock(bool bounded) noexcept {
    std::uint64_t deadline = 0;
    for (unsigned spins = 0;; ++spins) {
      bool expected = false;
      if (drain_lock.compare_exchange_weak(expected, true, std::memory_order_acquire)) return true;
      if ((spins & 63) == 63) {
        if (bounded) {
          std::uint64_t t = monotonic_ns();
          if (deadline == 0) deadline = t + 200'000'000ull;
          if (t > deadline) return false;
        }
        sched_yield();
      }
    }
  }
  void unlock() noexcept { drain_lock.store(false, std::memory_order_release); }

  // A producer's drain of a full ring. False: the drainer holding the lock drained nothing for
  // kProducerStallNs (or, once that happened, the lock was taken at all) and the caller drops
  // its record.
  bool drain_for_producer() noexcept {
    const bool stalled_now = stalled.load(std::memory_order_relaxed);
    std::uint64_t deadline = 0;
    std::uint64_t seen = batches.load(std::memory_order_relaxed);
    for (unsigned spins = 0;; ++spins) {
      bool expected = false;
      if (drain_lock.compare_exchange_weak(expected, true, std::memory_order_acquire)) break;
      if (stalled_now) return false;
      if ((spins & 63) == 63) {
        std::uint64_t t = monotonic_ns();
        const std::uint64_t now_seen = batches.load(std::memory_order_relaxed);
        if (deadline == 0 || now_seen != seen) deadline = t + kProducerStallNs;
        seen = now_seen;
        if (t > deadline) {
          stalled.store(true, std::memory_order_relaxed);
          return false;
        }
        sched_yield();
      }
    }
    drain_locked();
    unlock();
    return true;
  }

  char* format(char* p, const Record& r) const noexcept {
    p = put_dec(p, r.tid);
    *p++ = ',';
    std::int64_t secs = static_cast<std::int64_t>(r.time_ns / 1000000000ull) + utc_offset_s;
    std::uint64_t sod = static_cast<std::uint64_t>(((secs % 86400) + 86400) % 86400);
    p = put_dec_fixed(p, sod / 3600, 2);
    *p++ = ':';
    p = put_dec_fixed(p, sod / 60 % 60, 2);
    *p++ = ':';
    p = put_dec_fixed(p, sod % 60, 2);
    *p++ = '.';
    p = put_dec_fixed(p, r.time_ns % 1000000000ull / 1000, 6);
    *p++ = ',';
    p = put_str(p, r.action == kActionAllocate ? "allocate" : "free");
    *p++ = ',';
    p = put_hex(p, r.ptr);
    *p++ = ',';
    p = put_dec(p, r.size);
    *p++ = ',';
    p = put_hex(p, r.stream);
    *p++ = ',';
    if (r.device < 0) {
      *p++ = '-';
      p = put_dec(p, static_cast<std::uint64_t>(-static_cast<std::int64_t>(r.device)));
    } else {
      p = put_dec(p, static_cast<std::uint64_t>(r.device));
    }
    *p++ = ',';
    if (r.served != kNoServedBy) p = put_str(p, served_by_name(r.served));
    *p++ = '\n';
    return p;
  }

  // Writes [data, data+n); on failure reports once and marks the writer failed.
  bool write_all(const char* data, std::size_t n) noexcept {
    const std::size_t total = n;
    while (n > 0) {
      ssize_t w = ::write(fd, data, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        int err = w < 0 ? errno : ENOSPC;
        // Cut a partly written batch back to the last whole line, so the file stays readable.
        if (ftruncate(fd, static_cast<off_t>(committed)) == 0) lseek(fd, 0, SEEK_END);
        fail(err);
        return false;
      }
      data += w;
      n -= static_cast<std::size_t>(w);
    }
    committed += total;
    return true;
  }

  // "gpustitch: trace file PATH: " (the path cut at 400 bytes) at p; returns the end.
  char* put_path_prefix(char* p) const noexcept {
    p = put_str(p, "gpustitch: trace file ");
    const char* path = owner->options_.path.c_str();
    const std::size_t len = strnlen(path, 400);
    memcpy(p, path, len);
    p += len;
    return put_str(p, ": ");
  }

  void fail(int err) noexcept {
    if (owner->failed_.exchange(true)) return;
    char msg[512 + 64];
    char* p = put_path_prefix(msg);
    if (const char* t = errno_text(err)) {
      p = put_str(p, t);
    } else {
      p = put_str(p, "error ");
      p = put_dec(p, static_cast<std::uint64_t>(err));
    }
    p = put_str(p, "; tracing stopped, the program continues\n");
    write_all_stderr(msg, static_cast<std::size_t>(p - msg));
  }

  // Drains every published record. Returns false when the lock could not be taken.
  bool drain(bool bounded) noexcept {
    if (slots == nullptr) return true;
    if (!lock(bounded)) return false;
    drain_locked();
    unlock();
    return true;
  }

  // The drain itself; the caller holds drain_lock.
  void drain_locked() noexcept {
    if (slots == nullptr) return;
    for (;;) {
      char* p = buf;
      std::uint64_t taken = 0;
      while (static_cast<std::size_t>(p - buf) + kMaxLine <= kBufSize) {
        Slot& s = slots[head & mask];
        if (s.seq.load(std::memory_order_acquire) != head + 1) break;
        Record r = s.rec;
        s.seq.store(head + mask + 1, std::memory_order_release);
        ++head;
        ++taken;
        p = format(p, r);
      }
      if (taken == 0) break;
      if (owner->failed_.load(std::memory_order_relaxed) || fd < 0) {
        owner->dropped_.fetch_add(taken, std::memory_order_relaxed);
        continue;
      }
      if (write_all(buf, static_cast<std::size_t>(p - buf))) {
        owner->written_.fetch_add(taken, std::memory_order_relaxed);
      } else {
        owner->dropped_.fetch_add(taken, std::memory_order_relaxed);
      }
      batches.fetch_add(1, std::memory_order_relaxed);
    }
    stalled.store(false, std::memory_order_relaxed);
  }

  // Reports dropped records once (close or exit), so a short trace never passes for whole.
  void report_dropped() noexcept {
    const std::uint64_t n = owner->dropped_.load(std::memory_order_relaxed);
    if (n == 0 || owner->failed_.load(std::memory_order_relaxed) || dropped_reported.exchange(true))
      return;
    char msg[512 + 128];
    char* p = put_path_prefix(msg);
    p = put_dec(p, n);
    p = put_str(p, n == 1 ? " record" : " records");
    p = put_str(p, " dropped (writing the file could not keep up); the trace is incomplete\n");
    write_all_stderr(msg, static_cast<std::size_t>(p - msg));
  }

  static void* thread_main(void* arg) {
    auto* self = static_cast<Impl*>(arg);
    self->thread_started.store(true, std::memory_order_release);
    const unsigned ms =
        self->owner->options_.flush_interval_ms ? self->owner->options_.flush_interval_ms : 20;
    while (!self->stop.load(std::memory_order_acquire)) {
      self->drain(false);
      timespec ts{static_cast<time_t>(ms / 1000), static_cast<long>(ms % 1000) * 1000000L};
      nanosleep(&ts, nullptr);
    }
    self->drain(false);
    return nullptr;
  }
};

namespace {

void flush_all_for_signal() noexcept {
  for (auto& slot : g_writers) {
    TraceWriter* w = slot.load(std::memory_order_acquire);
    if (w != nullptr) w->flush();
  }
}

void flush_all_at_exit() {
  for (auto& slot : g_writers) {
    TraceWriter* w = slot.load(std::memory_order_acquire);
    if (w != nullptr && w->options().flush_at_exit) {
      w->flush();
      w->report_dropped();
    }
  }
}

void fork_child_all() {
  for (auto& slot : g_writers) {
    TraceWriter* w = slot.load(std::memory_order_acquire);
    if (w != nullptr) w->on_fork_child();
  }
}

void sigterm_handler(int sig, siginfo_t* info, void* context) {
  int saved_errno = errno;
  flush_all_for_signal();
  const struct sigaction& prev = g_previous_sigterm;
  if ((prev.sa_flags & SA_SIGINFO) && prev.sa_sigaction != nullptr) {
    prev.sa_sigaction(sig, info, context);
  } else if (prev.sa_handler == SIG_IGN) {
    // The program ignored SIGTERM before we came: keep ignoring it.
  } else if (prev.sa_handler == SIG_DFL) {
    // Restore the default action and re-raise: SIGTERM is blocked while this handler runs, so it
    // is delivered (and terminates the process) as soon as the handler returns.
    sigaction(SIGTERM, &prev, nullptr);
    raise(SIGTERM);
  } else {
    prev.sa_handler(sig);
  }
  errno = saved_errno;
}

void install_process_hooks(bool sigterm) {
  if (!g_hooks_installed.exchange(true)) {
    std::atexit(flush_all_at_exit);
    pthread_atfork(nullptr, nullptr, fork_child_all);
  }
  if (sigterm && !g_sigterm_installed.exchange(true)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = sigterm_handler;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGTERM, &sa, &g_previous_sigterm) != 0) g_sigterm_installed.store(false);
  }
}

}  // namespace

TraceWriter::TraceWriter(TraceWriterOptions options) : options_(std::move(options)) {
  impl_ = std::make_unique<Impl>();
  Impl& im = *impl_;
  im.owner = this;
  std::size_t cap = 1024;
  while (cap < options_.ring_records) cap <<= 1;
  im.mask = cap - 1;
  im.slots = new (std::nothrow) Slot[cap];
  im.buf = new (std::nothrow) char[Impl::kBufSize];
  if (im.slots == nullptr || im.buf == nullptr) {
    im.fail(ENOMEM);
    return;
  }
  for (std::size_t i = 0; i < cap; ++i) im.slots[i].seq.store(i, std::memory_order_relaxed);

  time_t t = time(nullptr);
  struct tm local;
  if (localtime_r(&t, &local) != nullptr) im.utc_offset_s = local.tm_gmtoff;

  // Judge the path before opening it (opening a device can have effects of its own), then the
  // descriptor itself (the path may have changed in between). O_NONBLOCK: see the header.
  struct stat st;
  if (::stat(options_.path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    im.fail(kNotRegularFile);
    return;
  }
  im.fd = ::open(options_.path.c_str(),
                 O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0644);
  if (im.fd < 0) {
    im.fail(errno);
    return;
  }
  if (::fstat(im.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(im.fd);
    im.fd = -1;
    im.fail(kNotRegularFile);
    return;
  }
  std::string header = std::string(kTraceHeader) + "\n";
  if (!im.write_all(header.data(), header.size())) return;

  // Register for the signal handler, atexit and fork hooks.
  bool registered = false;
  for (auto& slot : g_writers) {
    TraceWriter* expected = nullptr;
    if (slot.compare_exchange_strong(expected, this)) {
      registered = true;
      break;
    }
  }
  if (registered) install_process_hooks(options_.handle_sigterm);

  if (options_.start_thread) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    im.thread_running = pthread_create(&im.thread, nullptr, &Impl::thread_main, &im) == 0;
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    // Return only once the thread runs our code. A new thread first runs its runtime's start-up
    // (glibc's, and a sanitizer's, which allocates under locks that have no fork handler): a
    // program that fork()s right after creating the writer would otherwise give the child a copy
    // of those locks held by a thread that does not exist there, and the child would deadlock in
    // its next allocation or at exit (seen with ASan's allocator in LeakSanitizer's exit check).
    // A thread starts within microseconds; the wait is bounded (1 s) all the same.
    const std::uint64_t give_up = monotonic_ns() + 1000000000ull;
    while (im.thread_running && !im.thread_started.load(std::memory_order_acquire) &&
           monotonic_ns() < give_up)
      sched_yield();
  }
  enabled_.store(true, std::memory_order_release);
}

TraceWriter::~TraceWriter() {
  close();
  if (impl_) {
    // A signal handler that loaded this writer before close() unregistered it holds the drain
    // lock while it uses the ring: wait for it before freeing.
    if (impl_->slots != nullptr && !impl_->in_child.load()) {
      impl_->lock(true);
      impl_->unlock();
    }
    delete[] impl_->slots;
    delete[] impl_->buf;
  }
}

void TraceWriter::record(std::uint8_t action, int device, DevPtr ptr, std::size_t size,
                         Stream stream, ServedBy how) noexcept {
  if (!enabled_.load(std::memory_order_relaxed)) return;
  Impl& im = *impl_;
  Record r;
  r.time_ns = now_ns();
  r.ptr = ptr;
  r.size = size;
  r.stream = stream;
  r.tid = thread_id();
  r.device = static_cast<std::int16_t>(device);
  r.action = action;
  r.served = action == kActionAllocate ? static_cast<std::uint8_t>(how) : kNoServedBy;

  std::uint64_t pos = im.tail.load(std::memory_order_relaxed);
  Slot* slot;
  for (;;) {
    slot = &im.slots[pos & im.mask];
    std::uint64_t seq = slot->seq.load(std::memory_order_acquire);
    std::int64_t diff = static_cast<std::int64_t>(seq) - static_cast<std::int64_t>(pos);
    if (diff == 0) {
      if (im.tail.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) break;
    } else if (diff < 0) {
      // Ring full: drain it ourselves rather than drop or wait for the writer thread.
      if (failed_.load(std::memory_order_relaxed) || !enabled_.load(std::memory_order_relaxed)) {
        dropped_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      if (!im.drain_for_producer()) {
        dropped_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      pos = im.tail.load(std::memory_order_relaxed);
    } else {
      pos = im.tail.load(std::memory_order_relaxed);
    }
  }
  slot->rec = r;
  slot->seq.store(pos + 1, std::memory_order_release);
}

void TraceWriter::on_allocate(int device, DevPtr ptr, std::size_t size, Stream stream,
                              ServedBy how) noexcept {
  record(kActionAllocate, device, ptr, size, stream, how);
}

void TraceWriter::on_free(int device, DevPtr ptr, std::size_t size, Stream stream) noexcept {
  record(kActionFree, device, ptr, size, stream, ServedBy::cache);
}

void TraceWriter::flush() noexcept {
  if (!impl_ || impl_->in_child.load(std::memory_order_relaxed)) return;
  impl_->drain(true);
}

void TraceWriter::close() noexcept {
  if (!impl_) return;
  Impl& im = *impl_;
  enabled_.store(false, std::memory_order_release);
  for (auto& slot : g_writers) {
    TraceWriter* expected = this;
    slot.compare_exchange_strong(expected, nullptr);
  }
  if (im.in_child.load()) return;  // the writer thread and the file belong to the parent
  if (im.thread_running) {
    im.stop.store(true, std::memory_order_release);
    pthread_join(im.thread, nullptr);
    im.thread_running = false;
  }
  im.drain(false);
  if (im.fd >= 0) {
    ::close(im.fd);
    im.fd = -1;
  }
  im.report_dropped();
}

void TraceWriter::report_dropped() noexcept {
  if (impl_ && !impl_->in_child.load(std::memory_order_relaxed)) impl_->report_dropped();
}

void TraceWriter::on_fork_child() noexcept {
  enabled_.store(false, std::memory_order_relaxed);
  if (impl_) {
    impl_->in_child.store(true);
    impl_->thread_running = false;
  }
}

std::unique_ptr<TraceWriter> make_trace_writer(const Config& config) {
  if (config.trace_path.empty()) return nullptr;
  try {
    TraceWriterOptions o;
    o.path = config.trace_path;
    return std::make_unique<TraceWriter>(std::move(o));
  } catch (...) {
    return nullptr;  // out of host memory: no trace, the program is unaffected
  }
}

}  // namespace gpustitch::trace
