// `gpustitch run [--conf K:V,...] [--keep-framework-cache] -- CMD ARGS`: runs a program with
// libgpustitch.so preloaded.
//
// It sets LD_PRELOAD (the library's absolute path, ahead of anything already preloaded) and
// GPUSTITCH_CONF, then execs the program, so the program's exit status is run's exit status and
// signals reach it directly. Exec'd children inherit the shim through the environment.
//
// Frameworks that keep their own cache of device memory hide their fragmentation from any allocator
// underneath: under PyTorch's default caching allocator the shim sees a few dozen segment
// allocations and none of the tensors inside them. So by default run also asks the known frameworks
// to hand every allocation down (framework_env.h: PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync,
// or PYTORCH_NO_CUDA_MEMORY_CACHING=1 beside a PYTORCH_CUDA_ALLOC_CONF of the user's that names no
// backend; XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async and XLA_PYTHON_CLIENT_PREALLOCATE=false;
// TF_GPU_ALLOCATOR=cuda_malloc_async) and says so on stderr; --keep-framework-cache leaves them
// alone. A variable the user already set is kept.
//
// GPUSTITCH_CONF starts with summary:on, so the program prints the pool's one-line summary per
// device at exit (what a user of run wants to see: did the pool serve, how much did it hold); the
// user's GPUSTITCH_CONF and --conf come after it and win (summary:off).
//
// --conf is parsed before anything runs: an unknown key (with the nearest known one suggested) or
// a bad value is a usage error (exit 2) and the program is not started.
//
// The library is looked up, in order: $GPUSTITCH_LIBRARY; next to the executable (../lib,
// ../lib64, ../lib/<multiarch> of an installation; ../preload of a build tree); the system's
// library directories.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "command.h"
#include "framework_env.h"
#include "gpustitch/config.h"
#include "terminal_text.h"

namespace gpustitch::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLibrary = "libgpustitch.so";

#if defined(__x86_64__)
constexpr const char* kMultiarch = "x86_64-linux-gnu";
#elif defined(__aarch64__)
constexpr const char* kMultiarch = "aarch64-linux-gnu";
#else
constexpr const char* kMultiarch = "";
#endif

struct RunOptions {
  std::string conf;
  bool keep_framework_cache = false;
  bool dry_run = false;
  std::vector<std::string> command;
};

std::vector<fs::path> library_candidates() {
  std::vector<fs::path> out;
  if (const char* env = std::getenv("GPUSTITCH_LIBRARY"); env && *env) out.emplace_back(env);
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path prefix = exe.parent_path().parent_path();
    out.push_back(prefix / "lib" / kLibrary);
    out.push_back(prefix / "lib64" / kLibrary);
    if (*kMultiarch) out.push_back(prefix / "lib" / kMultiarch / kLibrary);
    out.push_back(prefix / "preload" / kLibrary);  // build tree: build/tools -> build/preload
  }
  if (*kMultiarch) {
    out.push_back(fs::path("/usr/lib") / kMultiarch / kLibrary);
    out.push_back(fs::path("/usr/local/lib") / kMultiarch / kLibrary);
  }
  out.emplace_back(std::string("/usr/local/lib/") + kLibrary);
  out.emplace_back(std::string("/usr/lib/") + kLibrary);
  out.emplace_back(std::string("/usr/lib64/") + kLibrary);
  return out;
}

// parse_config's messages start with "GPUSTITCH_CONF: "; here the option is named instead.
std::string without_conf_prefix(const std::string& e) {
  constexpr std::string_view kPrefix = "GPUSTITCH_CONF: ";
  return e.rfind(kPrefix, 0) == 0 ? e.substr(kPrefix.size()) : e;
}

// The absolute path of the library, or empty.
std::string find_library() {
  for (const fs::path& p : library_candidates()) {
    std::error_code ec;
    if (fs::is_regular_file(p, ec)) {
      fs::path abs = fs::canonical(p, ec);
      return ec ? fs::absolute(p).string() : abs.string();
    }
  }
  return {};
}

// LD_PRELOAD with lib first; an existing entry naming the same file is dropped (not preloaded
// twice). glibc separates entries with ':' or whitespace.
std::string preload_value(const std::string& lib, const char* existing) {
  std::string out = lib;
  if (!existing) return out;
  std::string cur = existing;
  std::size_t i = 0;
  while (i < cur.size()) {
    std::size_t j = cur.find_first_of(": \t", i);
    if (j == std::string::npos) j = cur.size();
    std::string entry = cur.substr(i, j - i);
    if (!entry.empty() && entry != lib) out += ":" + entry;
    i = j + 1;
  }
  return out;
}

int run(const RunOptions& o, const GlobalOptions& global) {
  if (o.command.empty()) {
    std::cerr << "gpustitch run: no command given (usage: gpustitch run [options] -- CMD ARGS)\n";
    return kUsage;
  }
  // --conf is checked here, before the job starts: the library would only log a warning for an
  // unknown key or a bad value and run the job with the setting the user meant left out.
  if (const ConfigResult parsed = parse_config(o.conf); !parsed.errors.empty()) {
    for (const auto& e : parsed.errors)
      std::cerr << "gpustitch run: --conf: " << without_conf_prefix(e) << "\n";
    return kUsage;
  }
  std::string lib = find_library();
  if (lib.empty()) {
    std::cerr << "gpustitch run: " << kLibrary
              << " not found (looked next to this program and in the system library "
                 "directories; set GPUSTITCH_LIBRARY to its path)\n";
    return kNotFound;
  }
  std::vector<std::pair<std::string, std::string>> set;
  set.emplace_back("LD_PRELOAD", preload_value(lib, std::getenv("LD_PRELOAD")));
  {
    // Later entries win: the environment overrides the default, the command line both.
    std::string conf = "summary:on";
    const char* existing = std::getenv("GPUSTITCH_CONF");
    if (existing && *existing) conf += std::string(",") + existing;
    if (!o.conf.empty()) conf += "," + o.conf;
    set.emplace_back("GPUSTITCH_CONF", conf);
  }
  std::vector<std::string> framework;
  if (!o.keep_framework_cache) {
    for (auto& [name, value] : framework_settings([](const char* n) { return std::getenv(n); })) {
      framework.push_back(name + "=" + value);
      set.emplace_back(std::move(name), std::move(value));
    }
  }
  if (!framework.empty() && !global.json) {
    std::string list;
    for (const auto& f : framework) list += (list.empty() ? "" : " ") + f;
    std::cerr << "gpustitch run: asking frameworks to hand every allocation to gpustitch: " << list
              << " (--keep-framework-cache keeps their own caches)\n";
  }
  if (o.dry_run) {
    if (global.json) {
      nlohmann::json j;
      j["library"] = lib;
      j["environment"] = nlohmann::json::object();
      for (const auto& [k, v] : set) j["environment"][k] = v;
      j["command"] = o.command;
      std::cout << terminal_json(j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace))
                << "\n";
    } else {
      for (const auto& [k, v] : set) std::cout << k << "=" << v << "\n";
      for (const auto& a : o.command) std::cout << a << (&a == &o.command.back() ? "\n" : " ");
    }
    return kOk;
  }
  for (const auto& [k, v] : set) setenv(k.c_str(), v.c_str(), 1);
  std::vector<char*> argv;
  for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::cout.flush();
  execvp(argv[0], argv.data());
  int err = errno;
  std::cerr << "gpustitch run: cannot run " << o.command[0] << ": " << std::strerror(err) << "\n";
  return err == ENOENT ? 127 : 126;  // as shells report it
}

Registrar registrar{
    "run", "Run a program with libgpustitch.so preloaded (gpustitch run [options] -- CMD ARGS)",
    [](CLI::App& sub, GlobalOptions& global) -> std::function<int()> {
      auto o = std::make_shared<RunOptions>();
      sub.add_option("--conf", o->conf,
                     "Pool configuration, K:V,... (appended to GPUSTITCH_CONF; see "
                     "docs/preload.md)");
      sub.add_flag("--keep-framework-cache", o->keep_framework_cache,
                   "Leave PyTorch/JAX/TensorFlow caching allocators on (the pool then sees only "
                   "their segments)");
      sub.add_flag("--dry-run", o->dry_run,
                   "Print the environment and command instead of running it");
      sub.add_option("command", o->command, "The program and its arguments, after --")
          ->expected(-1);
      sub.positionals_at_end();
      return [o, &global] { return run(*o, global); };
    }};

}  // namespace
}  // namespace gpustitch::cli
