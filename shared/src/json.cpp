// JSON form of records and the small client for gpustitchd's socket. See json.h.
#include "gpustitch/shm/json.h"

#include <poll.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>

namespace gpustitch::shm {
using nlohmann::json;

std::string uuid_string(const std::uint8_t (&uuid)[kUuidBytes]) {
  bool any = false;
  for (auto b : uuid) any |= b != 0;
  if (!any) return {};
  char buf[64];
  std::snprintf(buf, sizeof buf,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", uuid[0],
                uuid[1], uuid[2], uuid[3], uuid[4], uuid[5], uuid[6], uuid[7], uuid[8], uuid[9],
                uuid[10], uuid[11], uuid[12], uuid[13], uuid[14], uuid[15]);
  return buf;
}

std::string user_name(uid_t uid) {
  // The passwd lookup reads /etc/passwd (or asks NSS) every time: cache it, a listing of 1,000
  // processes would otherwise spend most of its time here. Single-threaded callers only.
  static std::map<uid_t, std::string> cache;
  if (auto it = cache.find(uid); it != cache.end()) return it->second;
  passwd pw, *res = nullptr;
  char buf[1024];
  std::string name = ::getpwuid_r(uid, &pw, buf, sizeof buf, &res) == 0 && res
                         ? std::string(res->pw_name)
                         : std::to_string(uid);
  if (cache.size() > 4096) cache.clear();
  cache.emplace(uid, name);
  return name;
}

json device_to_json(const DeviceCounters& d, JsonDetail detail) {
  json j;
  j["device"] = d.ordinal;
  j["uuid"] = uuid_string(d.uuid);
  if (detail == JsonDetail::summary) {
    j["bytes_allocated"] = d.bytes_allocated;
    j["bytes_reserved"] = d.bytes_reserved;
    j["bytes_cached"] = d.bytes_cached;
    j["largest_free_block"] = d.largest_free_block;
    j["stitches"] = d.stitches;
    j["ooms"] = d.ooms;
    j["device_free"] = d.device_free;
    j["device_total"] = d.device_total;
    j["program_held_bytes"] = d.program_held_bytes;
    j["program_mapped_bytes"] = d.program_mapped_bytes;
  } else {
#define GPUSTITCH_SHM_JSON(name) j[#name] = d.name;
    GPUSTITCH_SHM_DEVICE_COUNTERS(GPUSTITCH_SHM_JSON)
    GPUSTITCH_SHM_COOP_COUNTERS(GPUSTITCH_SHM_JSON)
    GPUSTITCH_SHM_PROGRAM_COUNTERS(GPUSTITCH_SHM_JSON)
    GPUSTITCH_SHM_DRIVER_COUNTERS(GPUSTITCH_SHM_JSON)
    GPUSTITCH_SHM_DRIVER_DETAIL_COUNTERS(GPUSTITCH_SHM_JSON)
    GPUSTITCH_SHM_WAIT_COUNTERS(GPUSTITCH_SHM_JSON)
#undef GPUSTITCH_SHM_JSON
  }
  j["fragmentation"] = d.fragmentation();
  if (detail == JsonDetail::full) {
    j["hist_allocs"] = std::vector<std::uint64_t>(d.hist_allocs, d.hist_allocs + kHistogramBuckets);
    j["hist_live"] = std::vector<std::uint64_t>(d.hist_live, d.hist_live + kHistogramBuckets);
  }
  return j;
}

json event_to_json(const EventCopy& e) {
  return json{{"index", e.index},      {"kind", e.known_kind ? to_string(e.kind) : "unknown"},
              {"device", e.device},    {"time_ns", e.time_ns},
              {"size", e.size},        {"device_free", e.device_free},
              {"cached", e.cached},    {"largest_possible", e.largest_possible},
              {"pieces", e.pieces},    {"fragmentation", e.fragmentation},
              {"peer_pid", e.peer_pid}};
}

json site_to_json(const SiteCopy& s) {
  json frames = json::array();
  for (const auto& f : s.frames)
    frames.push_back({{"function", f.function}, {"library", f.library}, {"offset", f.offset}});
  return json{{"live_bytes", s.live_bytes},
              {"count", s.count},
              {"device", s.device},
              {"frames", std::move(frames)}};
}

json identity_to_json(const ProcessIdentity& id, JsonDetail detail) {
  json j{{"pid", id.pid},
         {"uid", id.uid},
         {"user", user_name(id.uid)},
         {"exe", id.exe},
         {"command", id.cmdline}};
  // Counters newer than this layout (program_* before 3) are absent from the record, not zero.
  j["layout_version"] = id.layout_version;
  if (detail != JsonDetail::summary) {
    j["start_time"] = id.start_time;
    j["created_ns"] = id.created_ns;
    j["publish_interval_ms"] = id.publish_interval_ms;
  }
  return j;
}

void add_gpu_fields(json& process, const GpuInventory& gpus) {
  if (!process.is_object() || !process.contains("devices") || !process["devices"].is_array())
    return;
  for (auto& d : process["devices"]) {
    if (!d.is_object() || !d.contains("uuid") || !d["uuid"].is_string()) continue;
    std::array<std::uint8_t, kUuidBytes> uuid;
    if (!parse_uuid_text(d["uuid"].get<std::string>(), &uuid)) continue;
    const GpuInfo* g = gpus.find(uuid);
    if (!g) continue;
    d["gpu"] = g->index;
    d["gpu_name"] = g->name;
    d["pci_bus_id"] = g->bus_id;
  }
}

namespace {
json process_json(const RecordReader& reader, const SnapshotCopy& snap, JsonDetail detail) {
  json j = identity_to_json(reader.identity(), detail);
  j["heartbeat_ns"] = snap.heartbeat_ns;
  j["publish_count"] = snap.publish_count;
  json devices = json::array();
  for (const auto& d : snap.devices) devices.push_back(device_to_json(d, detail));
  j["devices"] = std::move(devices);
  if (detail == JsonDetail::full) {
    std::vector<EventCopy> events;
    std::uint64_t dropped = 0;
    json ev = json::array();
    if (reader.read_events(&events, &dropped) == ReadError::none)
      for (const auto& e : events) ev.push_back(event_to_json(e));
    j["events"] = std::move(ev);
    j["events_dropped"] = dropped;
    std::vector<SiteCopy> sites;
    json st = json::array();
    if (reader.read_sites(&sites) == ReadError::none)
      for (const auto& s : sites) st.push_back(site_to_json(s));
    j["sites"] = std::move(st);
  }
  return j;
}
}  // namespace

std::optional<json> read_process_json(const RecordReader& reader, JsonDetail detail,
                                      ReadError* err) {
  SnapshotCopy snap;
  *err = reader.read_snapshot(&snap);
  if (*err != ReadError::none) return std::nullopt;
  return process_json(reader, snap, detail);
}

void scan_processes(std::string_view prefix,
                    const std::function<void(const RecordReader&, const SnapshotCopy&)>& visit) {
  uid_t me = ::geteuid();
  std::optional<uid_t> only;
  if (me != 0) only = me;
  std::uint64_t now = realtime_ns();
  for (const RecordName& name : discover_records(prefix, only)) {
    ReadError err;
    auto reader = RecordReader::open(name, only, &err);
    if (!reader) continue;
    SnapshotCopy snap;
    if (reader->read_snapshot(&snap) != ReadError::none) continue;
    std::uint64_t fresh_ns =
        std::max<std::uint64_t>(3ull * reader->identity().publish_interval_ms, 1000) * 1000000ull;
    bool fresh = name.uid == me && snap.heartbeat_ns <= now + 1000000000ull &&
                 now - std::min(now, snap.heartbeat_ns) < fresh_ns;
    if (!fresh && !record_process_alive(name)) continue;
    visit(*reader, snap);
  }
}

json scan_processes_json(std::string_view prefix, JsonDetail detail) {
  json list = json::array();
  scan_processes(prefix, [&](const RecordReader& reader, const SnapshotCopy& snap) {
    list.push_back(process_json(reader, snap, detail));
  });
  return list;
}

std::optional<json> query_daemon(const std::string& socket_path, const json& request,
                                 int timeout_ms, std::string* why) {
  auto text = query_daemon_text(socket_path, request, timeout_ms, why);
  if (!text) return std::nullopt;
  json answer = json::parse(*text, nullptr, false);
  if (answer.is_discarded()) {
    if (why) *why = "the daemon sent malformed JSON";
    return std::nullopt;
  }
  return answer;
}

std::optional<std::string> query_daemon_text(const std::string& socket_path, const json& request,
                                             int timeout_ms, std::string* why) {
  auto fail = [&](const std::string& what) -> std::optional<std::string> {
    if (why) *why = what;
    return std::nullopt;
  };
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof addr.sun_path) return fail("socket path too long");
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return fail(std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    return fail(socket_path + ": " + std::strerror(errno));
  timespec start;
  ::clock_gettime(CLOCK_MONOTONIC, &start);
  auto remaining = [&]() {
    timespec now;
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    long elapsed = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
    return static_cast<int>(std::max<long>(0, timeout_ms - elapsed));
  };
  std::string out = request.dump() + "\n";
  std::size_t sent = 0;
  while (sent < out.size()) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, remaining()) <= 0) return fail("timed out sending to the daemon");
    ssize_t n = ::send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail(std::string("send: ") + std::strerror(errno));
    sent += static_cast<std::size_t>(n);
  }
  std::string in;
  in.reserve(1 << 20);  // a list of 1,000 processes is about 400 KB
  char buf[65536];
  while (in.empty() || in.back() != '\n') {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, remaining()) <= 0) return fail("timed out waiting for the daemon");
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail(std::string("recv: ") + std::strerror(errno));
    if (n == 0) break;
    in.append(buf, static_cast<std::size_t>(n));
  }
  return in;
}

}  // namespace gpustitch::shm
