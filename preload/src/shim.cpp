// See shim.h for the design.
#include "shim.h"

#include <pthread.h>
#include <unistd.h>

#include <spdlog/sinks/stdout_sinks.h>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "coop.h"
#include "gpustitch/backend_factory.h"
#include "gpustitch/config.h"
#include "observer_fanout.h"
#include "observers.h"
#include "real_api.h"

namespace gpustitch::preload {

thread_local int t_passthrough_depth = 0;

namespace {

enum class State : int { uninitialized, serving, native };

std::atomic<State> g_state{State::uninitialized};
std::atomic<Pool*> g_pool{nullptr};
std::mutex g_init_mutex;
thread_local bool t_initializing = false;
pid_t g_owner_pid = 0;  // process that created the pool (the exit summary is its alone)
bool g_ipc_native = false;

constexpr int kMaxCountedDevices = 64;
std::atomic<std::uint64_t> g_passed_through[kMaxCountedDevices];

// Leaked on purpose (see shim.h): these outlive every static destructor.
Config* g_config = nullptr;
Backend* g_backend = nullptr;
ObserverFanout* g_fanout = nullptr;

spdlog::level::level_enum parse_level(const std::string& s) {
  auto level = spdlog::level::from_str(s);
  // from_str returns off for unknown names; config validation already rejected those.
  return level;
}

std::string human_bytes(std::uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) v /= 1024.0, ++u;
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

// One line per device at exit: at log_level:info and below, or with summary:on unless the log
// is off. Written straight to stderr in the second case, with the logger's prefix, because the
// logger drops info lines at the default level.
void print_summary() noexcept {
  Pool* pool = g_pool.load(std::memory_order_acquire);
  if (!pool || getpid() != g_owner_pid) return;
  auto& lg = log();
  const bool info = lg.should_log(spdlog::level::info);
  const bool forced = g_config && g_config->summary && lg.level() != spdlog::level::off;
  if (!info && !forced) return;
  try {
    for (int d = 0; d < pool->device_count(); ++d) {
      DeviceStats s = pool->stats(d);
      std::uint64_t passed =
          d < kMaxCountedDevices ? g_passed_through[d].load(std::memory_order_relaxed) : 0;
      const std::string line = fmt::format(
          "summary device {}: allocs {}, cache hits {}, fresh {}, stitches {}, OOMs {}, peak "
          "reserved {} (then {} allocated, {} waiting for the device), driver calls {} ({:.1f} "
          "ms; {} of them, {:.1f} ms, on the background thread), waits for the device {} "
          "({:.1f} ms; {} for the background thread's fence, {:.1f} ms, {} ran out), stream cuts "
          "split after their free's event {} (still running {}), passed through {} (backend {})",
          d, s.allocs, s.cache_hits, s.fresh, s.stitches, s.ooms, human_bytes(s.peak_reserved),
          human_bytes(s.peak_reserved_allocated), human_bytes(s.peak_reserved_pending),
          s.driver_calls, static_cast<double>(s.driver_ns) / 1e6, s.driver_background_calls,
          static_cast<double>(s.driver_background_ns) / 1e6, s.fence_syncs + s.fence_waits,
          static_cast<double>(s.fence_sync_ns + s.fence_wait_ns) / 1e6, s.fence_waits,
          static_cast<double>(s.fence_wait_ns) / 1e6, s.fence_waits_timed_out, s.cuts_after_event,
          s.cuts_event_running, passed, pool->backend().name());
      if (info) {
        lg.info("{}", line);
      } else {
        std::fprintf(stderr, "gpustitch: %s\n", line.c_str());
      }
    }
    lg.flush();
    std::fflush(stderr);
  } catch (...) {
  }
}

void fork_prepare() noexcept {
  g_init_mutex.lock();
  if (Pool* p = g_pool.load(std::memory_order_acquire)) p->atfork_prepare();
}
void fork_parent() noexcept {
  if (Pool* p = g_pool.load(std::memory_order_acquire)) p->atfork_parent();
  g_init_mutex.unlock();
}
void fork_child() noexcept {
  if (Pool* p = g_pool.load(std::memory_order_acquire)) {
    p->atfork_child();
    // The inherited pool describes the parent's device memory: never touch it again.
    g_pool.store(nullptr, std::memory_order_release);
    g_state.store(State::native, std::memory_order_release);
  }
  g_init_mutex.unlock();
}

// The configured backend (backend:sim for tests; cuda/auto: the driver, reached only through
// resolve_real_driver so the backend never calls a hook). Null, after one warning line, when the
// driver cannot be used.
std::unique_ptr<Backend> create_backend(const Config& config, spdlog::logger& lg) {
  std::string why;
  if (config.backend != BackendKind::sim && !libcuda()) {
    lg.warn(
        "libcuda.so.1 not found (no NVIDIA driver); running natively, allocations are not "
        "pooled");
    return nullptr;
  }
  auto backend = make_backend(config, &why, &resolve_real_driver, nullptr);
  if (!backend) {
    lg.warn("{}; running natively, allocations are not pooled",
            why.empty() ? "CUDA driver unavailable" : why);
  }
  return backend;
}

// Runs once, under g_init_mutex, with t_initializing set.
void initialize() noexcept {
  auto& lg = log();
  try {
    ConfigResult parsed = config_from_env();
    g_config = new Config(std::move(parsed.config));
    lg.set_level(parse_level(g_config->log_level));
    for (const auto& e : parsed.errors) lg.warn("{}", e);  // each names GPUSTITCH_CONF itself
    g_ipc_native = g_config->ipc_native;
    if (!g_config->enabled) {
      lg.debug("disabled by configuration (enable:off); passing every call through");
      g_state.store(State::native, std::memory_order_release);
      return;
    }
    std::unique_ptr<Backend> backend = create_backend(*g_config, lg);
    if (!backend) {
      g_state.store(State::native, std::memory_order_release);
      return;
    }
    g_fanout = new ObserverFanout();
    g_backend = backend.release();
    Pool* pool = new Pool(*g_backend, *g_config, g_fanout);
    if (pool->device_count() <= 0) {
      lg.warn("no CUDA device usable by the pool; running natively");
      g_state.store(State::native, std::memory_order_release);
      return;  // pool and backend leak: harmless, and safer than tearing down half-made state
    }
    add_configured_observers(*g_config, *pool, *g_fanout, lg);
    start_coop(*g_config, *pool, configured_publisher());
    g_owner_pid = getpid();
    pthread_atfork(&fork_prepare, &fork_parent, &fork_child);
    std::atexit(&print_summary);
    lg.debug("serving device allocations from the pool (backend {}, {} device(s))",
             g_backend->name(), pool->device_count());
    g_pool.store(pool, std::memory_order_release);
    g_state.store(State::serving, std::memory_order_release);
  } catch (...) {
    // Out of memory on the host while initialising: never propagate into the program.
    g_state.store(State::native, std::memory_order_release);
  }
}

Pool* initialize_slow() noexcept {
  if (t_initializing) return nullptr;  // a hook reached from inside initialisation
  {
    std::lock_guard lock(g_init_mutex);
    if (g_state.load(std::memory_order_acquire) == State::uninitialized) {
      t_initializing = true;
      initialize();
      t_initializing = false;
    }
  }
  return g_pool.load(std::memory_order_acquire);
}

}  // namespace

Pool* serving_pool() noexcept {
  if (t_passthrough_depth != 0) return nullptr;
  Pool* pool = g_pool.load(std::memory_order_acquire);
  if (pool) return pool;
  if (g_state.load(std::memory_order_acquire) != State::uninitialized) return nullptr;
  return initialize_slow();
}

Pool* existing_pool() noexcept {
  if (t_passthrough_depth != 0) return nullptr;
  return g_pool.load(std::memory_order_acquire);
}

bool shim_active() noexcept {
  if (g_pool.load(std::memory_order_acquire)) return true;
  if (g_state.load(std::memory_order_acquire) == State::uninitialized) initialize_slow();
  return g_pool.load(std::memory_order_acquire) != nullptr;
}

bool ipc_native() noexcept {
  return g_ipc_native;
}

void note_passthrough() noexcept {
  int device = 0;
  if (driver_current_device(&device) && device >= 0 && device < kMaxCountedDevices) {
    g_passed_through[device].fetch_add(1, std::memory_order_relaxed);
  }
}

spdlog::logger& log() noexcept {
  static spdlog::logger* logger = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
    auto* l = new spdlog::logger("gpustitch", std::move(sink));
    l->set_pattern("gpustitch: %v");
    l->set_level(spdlog::level::warn);
    l->flush_on(spdlog::level::trace);
    return l;
  }();
  return *logger;
}

Served serve_allocation(Pool& pool, int device, std::size_t size, Stream stream,
                        DevPtr* out) noexcept {
  switch (pool.allocate(device, size, stream, out)) {
    case Status::ok:
      return Served::ok;
    case Status::out_of_memory:
      log_oom(pool, device, size);
      return Served::out_of_memory;
    default:
      return Served::not_served;
  }
}

FreeServed serve_free_async(Pool& pool, DevPtr ptr, cuda::CUstream stream, bool per_thread,
                            const char* api, cuda::CUresult* error) noexcept {
  const Capture capture = stream_capture(stream, per_thread, error);
  if (capture == Capture::invalid) {
    // Not "capturing": the stream is gone. Native CUDA would reject the call; the block is freed
    // as cudaFree frees (fenced against all device work), or it would stay live for good.
    if (pool.deallocate(ptr, kAnyStream) != Status::ok) return FreeServed::not_served;
    log().debug("{} on a stream the driver rejects (error {}): freed with cudaFree semantics", api,
                static_cast<int>(*error));
    return FreeServed::invalid_stream;
  }
  if (capture == Capture::active) {
    if (!pool.find(ptr)) return FreeServed::not_served;
    log().error(
        "{} of pool memory on a capturing stream is not supported; allocate memory used by CUDA "
        "graphs inside the capture",
        api);
    return FreeServed::capture_unsupported;
  }
  return pool.deallocate(ptr, stream_key(stream, per_thread)) == Status::ok
             ? FreeServed::freed
             : FreeServed::not_served;
}

namespace {
// Devices the driver shows (cuDeviceGetCount), once it has answered; -1 until then.
std::atomic<int> g_visible_devices{-1};
// The calling thread has had a current context (see runtime_current_device in shim.h).
thread_local bool t_had_context = false;

bool single_visible_device() noexcept {
  int n = g_visible_devices.load(std::memory_order_relaxed);
  if (n < 0) {
    auto count = driver_calls().device_get_count;
    if (!count || count(&n) != cuda::CUDA_SUCCESS) return false;  // before cuInit: ask later
    g_visible_devices.store(n, std::memory_order_relaxed);
  }
  return n == 1;
}
}  // namespace

bool driver_current_device(int* device) noexcept {
  auto get = driver_calls().ctx_get_device;
  if (!get || get(device) != cuda::CUDA_SUCCESS) return false;
  t_had_context = true;
  return true;
}

bool runtime_current_device(int* device) noexcept {
  if (t_had_context && single_visible_device()) {
    *device = 0;
    return true;
  }
  if (driver_current_device(device)) return true;
  // No current context yet: the native runtime call would create the primary context of the
  // runtime's current device first. cudaFree(NULL) is the runtime's documented way to do just that.
  auto free_fn = real_as<cuda::PFN_cudaFree>(Hook::cudaFree);
  if (!free_fn) return false;
  {
    PassthroughScope guard;
    free_fn(nullptr);
  }
  return driver_current_device(device);
}

void ensure_runtime_context() noexcept {
  if (t_had_context) return;
  int device = 0;
  runtime_current_device(&device);
}

bool stream_device(cuda::CUstream stream, bool per_thread, bool runtime, int* device) noexcept {
  auto v = reinterpret_cast<std::uintptr_t>(stream);
  if (v > 2 && single_visible_device()) {
    *device = 0;
    return true;
  }
  if (v > 2) {
    const auto& d = driver_calls();
    auto get = per_thread ? d.stream_get_device_ptsz : d.stream_get_device;
    if (get) return get(stream, device) == cuda::CUDA_SUCCESS;
  }
  return runtime ? runtime_current_device(device) : driver_current_device(device);
}

Capture stream_capture(cuda::CUstream stream, bool per_thread, cuda::CUresult* error) noexcept {
  const auto& d = driver_calls();
  auto query = per_thread ? d.stream_is_capturing_ptsz : d.stream_is_capturing;
  if (!query) query = d.stream_is_capturing;
  if (!query) return Capture::none;  // a driver without graphs cannot capture
  int status = cuda::CU_STREAM_CAPTURE_STATUS_NONE;
  const cuda::CUresult rc = query(stream, &status);
  if (rc != cuda::CUDA_SUCCESS) {
    if (error) *error = rc;
    return Capture::invalid;
  }
  return status != cuda::CU_STREAM_CAPTURE_STATUS_NONE ? Capture::active : Capture::none;
}

bool stream_capturing(cuda::CUstream stream, bool per_thread) noexcept {
  return stream_capture(stream, per_thread) != Capture::none;
}

Stream stream_key(cuda::CUstream stream, bool per_thread) noexcept {
  auto v = reinterpret_cast<std::uintptr_t>(stream);
  bool thread_stream = v == 2 || (v == 0 && per_thread);
  if (!thread_stream) return v == 1 ? 0 : v;
  // Odd values above 2 are never CUstream handles (those are aligned pointers or 0/1/2), and never
  // kAnyStream (~0) for any realistic thread count.
  static std::atomic<std::uintptr_t> next_thread{1};
  thread_local std::uintptr_t key = 0;
  if (key == 0)
    key = (next_thread.fetch_add(1, std::memory_order_relaxed) << 4) | kPerThreadStreamTag;
  return key;
}

cuda::CUresult to_curesult(Status s) noexcept {
  switch (s) {
    case Status::ok:
      return cuda::CUDA_SUCCESS;
    case Status::out_of_memory:
      return cuda::CUDA_ERROR_OUT_OF_MEMORY;
    case Status::invalid_value:
      return cuda::CUDA_ERROR_INVALID_VALUE;
    case Status::invalid_device:
      return cuda::CUDA_ERROR_INVALID_DEVICE;
    case Status::not_supported:
      return cuda::CUDA_ERROR_NOT_SUPPORTED;
    case Status::not_initialized:
      return cuda::CUDA_ERROR_NOT_INITIALIZED;
    case Status::error:
      break;
  }
  return cuda::CUDA_ERROR_UNKNOWN;
}

cuda::cudaError to_cuda_error(Status s) noexcept {
  switch (s) {
    case Status::ok:
      return cuda::cudaSuccess;
    case Status::out_of_memory:
      return cuda::cudaErrorMemoryAllocation;
    case Status::invalid_value:
      return cuda::cudaErrorInvalidValue;
    case Status::invalid_device:
      return cuda::cudaErrorInvalidDevice;
    case Status::not_supported:
      return cuda::cudaErrorNotSupported;
    case Status::not_initialized:
      return cuda::cudaErrorInitializationError;
    case Status::error:
      break;
  }
  return cuda::cudaErrorUnknown;
}

void set_runtime_last_error_oom() noexcept {
  auto malloc_fn = real_as<cuda::PFN_cudaMalloc>(Hook::cudaMalloc);
  if (!malloc_fn) return;
  PassthroughScope guard;
  void* p = nullptr;
  // No device has 4 EiB: the runtime fails this with cudaErrorMemoryAllocation and records it.
  if (malloc_fn(&p, std::size_t{1} << 62) == cuda::cudaSuccess && p) {
    auto free_fn = real_as<cuda::PFN_cudaFree>(Hook::cudaFree);
    if (free_fn) free_fn(p);
  }
}

}  // namespace gpustitch::preload
