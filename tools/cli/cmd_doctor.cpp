// gpustitch doctor: is this machine ready for gpustitch? Driver present, virtual memory
// management supported on every device, gpustitchd reachable, preload library valid, shared
// memory usable. The driver is dlopen'ed here, never linked: doctor runs on machines without one.
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iostream>

#include "doctor.h"
#include "gpustitch/shm/json.h"
#include "gpustitch/shm/names.h"
#include "terminal_text.h"

namespace gpustitch::cli {
using nlohmann::json;

std::vector<DoctorCheckSpec>& doctor_checks() {
  static std::vector<DoctorCheckSpec> checks;
  return checks;
}

const char* to_string(DoctorLevel level) {
  switch (level) {
    case DoctorLevel::ok:
      return "ok";
    case DoctorLevel::warn:
      return "warn";
    case DoctorLevel::fail:
      return "fail";
    case DoctorLevel::skip:
      return "skip";
  }
  return "?";
}

namespace {

// The driver, opened once for the driver and vmm checks.
struct Driver {
  void* handle = nullptr;
  std::string error;
  int version = 0;
  CUresult init = CUDA_ERROR_NOT_INITIALIZED;
  int devices = 0;
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuDeviceGetName) device_name = nullptr;
  decltype(&cuDeviceGetAttribute) attribute = nullptr;
  decltype(&cuGetErrorString) error_string = nullptr;

  static Driver& get() {
    static Driver d = load();
    return d;
  }
  std::string describe(CUresult r) const {
    const char* s = nullptr;
    if (error_string && error_string(r, &s) == CUDA_SUCCESS && s) return s;
    return "CUresult " + std::to_string(static_cast<int>(r));
  }

 private:
  static Driver load() {
    Driver d;
    d.handle = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!d.handle) {
      const char* e = ::dlerror();
      d.error = e ? e : "libcuda.so.1 not found";
      return d;
    }
    auto sym = [&](const char* name) { return ::dlsym(d.handle, name); };
    auto init = reinterpret_cast<decltype(&cuInit)>(sym("cuInit"));
    auto version = reinterpret_cast<decltype(&cuDriverGetVersion)>(sym("cuDriverGetVersion"));
    auto count = reinterpret_cast<decltype(&cuDeviceGetCount)>(sym("cuDeviceGetCount"));
    d.device_get = reinterpret_cast<decltype(&cuDeviceGet)>(sym("cuDeviceGet"));
    d.device_name = reinterpret_cast<decltype(&cuDeviceGetName)>(sym("cuDeviceGetName"));
    d.attribute = reinterpret_cast<decltype(&cuDeviceGetAttribute)>(sym("cuDeviceGetAttribute"));
    d.error_string = reinterpret_cast<decltype(&cuGetErrorString)>(sym("cuGetErrorString"));
    if (!init || !count || !d.device_get || !d.attribute) {
      d.error = "libcuda.so.1 lacks cuInit/cuDeviceGetCount/cuDeviceGetAttribute";
      return d;
    }
    if (version) version(&d.version);
    d.init = init(0);
    if (d.init == CUDA_SUCCESS) count(&d.devices);
    return d;
  }
};

DoctorCheck driver_check{"driver", 10, [](const DoctorContext&) {
                           Driver& d = Driver::get();
                           DoctorResult r;
                           if (!d.handle || !d.error.empty()) {
                             r.level = DoctorLevel::fail;
                             r.summary = "CUDA driver not usable: " + d.error;
                             return r;
                           }
                           r.data = {{"driver_version", d.version}};
                           if (d.init != CUDA_SUCCESS) {
                             r.level = DoctorLevel::fail;
                             r.summary = "cuInit failed: " + d.describe(d.init);
                             return r;
                           }
                           r.data["devices"] = d.devices;
                           r.summary = "libcuda.so.1 loaded, driver API " +
                                       std::to_string(d.version / 1000) + "." +
                                       std::to_string(d.version % 1000 / 10) + ", " +
                                       std::to_string(d.devices) + " device(s)";
                           if (d.devices == 0) r.level = DoctorLevel::warn;
                           return r;
                         }};

DoctorCheck vmm_check{
    "vmm", 20, [](const DoctorContext&) {
      Driver& d = Driver::get();
      DoctorResult r;
      if (!d.handle || d.init != CUDA_SUCCESS) {
        r.level = DoctorLevel::skip;
        r.summary = "no usable driver";
        return r;
      }
      json devices = json::array();
      int missing = 0;
      for (int i = 0; i < d.devices; ++i) {
        CUdevice dev;
        char name[256] = "?";
        int vmm = 0;
        CUresult e = d.device_get(&dev, i);
        if (e == CUDA_SUCCESS && d.device_name) d.device_name(name, sizeof name, dev);
        if (e == CUDA_SUCCESS)
          e = d.attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
        bool ok = e == CUDA_SUCCESS && vmm;
        missing += ok ? 0 : 1;
        r.lines.push_back("device " + std::to_string(i) + " (" + name + "): " +
                          (ok                  ? "VMM supported"
                           : e != CUDA_SUCCESS ? d.describe(e)
                                               : "no VMM support"));
        devices.push_back({{"device", i}, {"name", name}, {"vmm", ok}});
      }
      r.data["devices"] = devices;
      r.level = missing ? DoctorLevel::fail : d.devices ? DoctorLevel::ok : DoctorLevel::skip;
      r.summary = missing ? std::to_string(missing) + " device(s) without virtual memory management"
                          : "virtual memory management supported on every device";
      return r;
    }};

DoctorCheck daemon_check{
    "daemon", 30, [](const DoctorContext& ctx) {
      DoctorResult r;
      std::string path = socket_path(ctx.source);
      std::string why;
      auto answer = shm::query_daemon(path, json{{"cmd", "status"}}, 2000, &why);
      r.data = {{"socket", path}};
      if (!answer || !answer->value("ok", false)) {
        r.level = DoctorLevel::warn;
        r.summary = "gpustitchd not reachable at " + path + " (" + (answer ? "bad answer" : why) +
                    "); the CLI falls back to reading your own records";
        return r;
      }
      r.data["tracked"] = answer->value("tracked", 0);
      r.summary = "gpustitchd answers at " + path + ", tracking " +
                  std::to_string(answer->value("tracked", 0)) + " process(es) you can see";
      return r;
    }};

// Where the preload library should be, in order: --library (or --preload), $GPUSTITCH_LIBRARY
// (the variable `gpustitch run` reads), next to the CLI in a build tree, the install prefix.
std::vector<std::string> preload_candidates(const DoctorContext& ctx) {
  std::vector<std::string> c;
  if (!ctx.preload.empty()) return {ctx.preload};
  if (const char* e = std::getenv("GPUSTITCH_LIBRARY"); e && *e) return {e};
  std::string exe = shm::self_exe();
  if (!exe.empty()) {
    auto dir = std::filesystem::path(exe).parent_path();
    c.push_back((dir.parent_path() / "preload" / "libgpustitch.so").string());
    c.push_back((dir.parent_path() / "lib" / "libgpustitch.so").string());
    c.push_back((dir.parent_path() / "lib" / "gpustitch" / "libgpustitch.so").string());
  }
#ifdef GPUSTITCH_LIBDIR
  c.push_back(std::string(GPUSTITCH_LIBDIR) + "/libgpustitch.so");
#endif
  c.push_back("/usr/lib/x86_64-linux-gnu/libgpustitch.so");
  c.push_back("/usr/local/lib/libgpustitch.so");
  return c;
}

DoctorCheck preload_check{
    "preload", 40, [](const DoctorContext& ctx) {
      DoctorResult r;
      for (const auto& path : preload_candidates(ctx)) {
        int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        unsigned char head[20] = {};
        ssize_t n = ::read(fd, head, sizeof head);
        ::close(fd);
        r.data = {{"path", path}};
        bool elf = n >= 20 && head[0] == 0x7f && head[1] == 'E' && head[2] == 'L' && head[3] == 'F';
        bool shared = elf && head[4] == 2 /* 64-bit */ && head[16] == 3 /* ET_DYN */;
        if (!shared) {
          r.level = DoctorLevel::fail;
          r.summary = path + " is not a 64-bit shared library";
          return r;
        }
        r.summary = "preload library " + path;
        const char* preload = std::getenv("LD_PRELOAD");
        if (preload && std::string(preload).find("gpustitch") != std::string::npos)
          r.lines.push_back("LD_PRELOAD=" + std::string(preload));
        r.lines.push_back("use: LD_PRELOAD=" + path + " <program>   (or: gpustitch run <program>)");
        return r;
      }
      r.level = DoctorLevel::fail;
      r.summary = "libgpustitch.so not found (set GPUSTITCH_LIBRARY or pass --library)";
      return r;
    }};

DoctorCheck shm_check{"shm", 45, [](const DoctorContext& ctx) {
                        DoctorResult r;
                        struct stat st;
                        if (::stat(shm::kShmDir, &st) != 0 || !S_ISDIR(st.st_mode) ||
                            ::access(shm::kShmDir, W_OK) != 0) {
                          r.level = DoctorLevel::fail;
                          r.summary = std::string(shm::kShmDir) +
                                      " missing or not writable: statistics cannot be published";
                          return r;
                        }
                        auto mine = shm::discover_records(record_prefix(ctx.source), ::geteuid());
                        r.data = {{"own_records", mine.size()}};
                        r.summary = std::string(shm::kShmDir) + " writable, " +
                                    std::to_string(mine.size()) + " record(s) of yours";
                        return r;
                      }};

Registrar reg{
    "doctor", "Check the driver, VMM support, gpustitchd, the preload library",
    [](CLI::App& sub, GlobalOptions& global) -> std::function<int()> {
      auto ctx = std::make_shared<DoctorContext>();
      sub.add_option("--socket", ctx->source.socket, "gpustitchd socket to check");
      sub.add_option("--library,--preload", ctx->preload,
                     "Preload library to check (default $GPUSTITCH_LIBRARY, as for run)");
      sub.add_option("--prefix", ctx->source.prefix, "Record name prefix (tests)")->group("");
      sub.footer("Exit status: 0 every check passed (warnings allowed), 1 a check failed.");
      return [ctx, &global]() {
        auto checks = doctor_checks();
        std::stable_sort(checks.begin(), checks.end(),
                         [](const auto& a, const auto& b) { return a.order < b.order; });
        json out = json::array();
        bool failed = false;
        for (const auto& c : checks) {
          DoctorResult r;
          try {
            r = c.run(*ctx);
          } catch (const std::exception& e) {
            r.level = DoctorLevel::fail;
            r.summary = std::string("check threw: ") + e.what();
          }
          failed |= r.level == DoctorLevel::fail;
          if (global.json) {
            out.push_back({{"check", c.name},
                           {"status", to_string(r.level)},
                           {"summary", r.summary},
                           {"details", r.lines},
                           {"data", r.data}});
          } else {
            std::string tag = r.level == DoctorLevel::ok     ? "[ ok ]"
                              : r.level == DoctorLevel::warn ? "[warn]"
                              : r.level == DoctorLevel::fail ? "[FAIL]"
                                                             : "[skip]";
            // Details quote files and other processes (config lines, library paths).
            std::cout << tag << " " << c.name << ": " << terminal_text(r.summary) << "\n";
            for (const auto& l : r.lines) std::cout << "       " << terminal_text(l) << "\n";
          }
        }
        if (global.json) print_json({{"ok", !failed}, {"checks", out}});
        return failed ? int(kProblem) : int(kOk);
      };
    }};

}  // namespace
}  // namespace gpustitch::cli
