#include "request.h"

#include <grp.h>

#include <cstdio>
#include <cstring>
#include <fstream>

#include "gpustitch/shm/json.h"

#ifndef GPUSTITCH_VERSION
#define GPUSTITCH_VERSION "unknown"
#endif

namespace gpustitch::daemon {
using nlohmann::json;

std::optional<Request> parse_request(std::string_view line, std::string* why) {
  auto fail = [&](const char* what) -> std::optional<Request> {
    if (why) *why = what;
    return std::nullopt;
  };
  if (line.size() > kMaxRequestBytes) return fail("request too long");
  // Depth and size are bounded by kMaxRequestBytes; parse without exceptions.
  json j = json::parse(line.begin(), line.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return fail("request is not a JSON object");
  auto cmd = j.find("cmd");
  if (cmd == j.end() || !cmd->is_string()) return fail("missing \"cmd\"");
  Request r;
  const std::string& c = cmd->get_ref<const std::string&>();
  if (c == "ping")
    r.cmd = Command::ping;
  else if (c == "list")
    r.cmd = Command::list;
  else if (c == "show")
    r.cmd = Command::show;
  else if (c == "status")
    r.cmd = Command::status;
  else
    return fail("unknown \"cmd\"");
  if (r.cmd == Command::show) {
    auto pid = j.find("pid");
    if (pid == j.end() || !pid->is_number_integer())
      return fail("\"show\" needs an integer \"pid\"");
    std::int64_t v = pid->get<std::int64_t>();
    if (v <= 0 || v > 0x3fffffff) return fail("\"pid\" out of range");
    r.pid = static_cast<pid_t>(v);
  }
  if (auto s = j.find("summary"); s != j.end()) {
    if (!s->is_boolean()) return fail("\"summary\" must be true or false");
    r.summary = s->get<bool>();
  }
  if (auto h = j.find("history_seconds"); h != j.end()) {
    if (!h->is_number_unsigned() || h->get<std::uint64_t>() > 7 * 86400ull)
      return fail("\"history_seconds\" must be 0..604800");
    r.history_seconds = h->get<std::uint32_t>();
  }
  return r;
}

std::vector<gid_t> process_groups(pid_t pid) {
  std::vector<gid_t> out;
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Groups:", 0) != 0) continue;
    const char* p = line.c_str() + 7;
    char* end;
    while (true) {
      unsigned long g = std::strtoul(p, &end, 10);
      if (end == p) break;
      out.push_back(static_cast<gid_t>(g));
      p = end;
    }
    break;
  }
  return out;
}

bool peer_sees_all(const Peer& peer, const std::string& admin_group) {
  if (peer.uid == 0) return true;
  if (admin_group.empty()) return false;
  group gr, *res = nullptr;
  char buf[4096];
  if (::getgrnam_r(admin_group.c_str(), &gr, buf, sizeof buf, &res) != 0 || !res) return false;
  if (peer.gid == res->gr_gid) return true;
  for (gid_t g : peer.groups)
    if (g == res->gr_gid) return true;
  return false;
}

json process_summary_json(const TrackedProcess& p, shm::JsonDetail detail,
                          const shm::GpuInventory* gpus) {
  json j = shm::identity_to_json(p.reader.identity(), detail);
  j["user"] = p.user;
  j["heartbeat_ns"] = p.snapshot.heartbeat_ns;
  j["publish_count"] = p.snapshot.publish_count;
  j["last_sample_ns"] = p.last_sample_ns;
  json devices = json::array();
  for (const auto& d : p.snapshot.devices) devices.push_back(shm::device_to_json(d, detail));
  j["devices"] = std::move(devices);
  if (gpus) shm::add_gpu_fields(j, *gpus);
  if (p.kube) {
    j["pod_uid"] = p.kube->pod_uid;
    if (!p.kube->container_id.empty()) j["container_id"] = p.kube->container_id;
  }
  return j;
}

json process_detail_json(const TrackedProcess& p, const shm::GpuInventory* gpus) {
  json j = process_summary_json(p, shm::JsonDetail::full, gpus);
  json events = json::array();
  for (const auto& e : p.events) events.push_back(shm::event_to_json(e));
  j["events"] = std::move(events);
  j["events_dropped"] = p.events_dropped;
  std::vector<shm::SiteCopy> sites;
  json st = json::array();
  if (p.reader.read_sites(&sites) == shm::ReadError::none)
    for (const auto& s : sites) st.push_back(shm::site_to_json(s));
  j["sites"] = std::move(st);
  return j;
}

namespace {
json history_json(const TrackedProcess& p, std::uint32_t seconds) {
  std::uint64_t now = shm::realtime_ns();
  std::uint64_t since = now > seconds * 1000000000ull ? now - seconds * 1000000000ull : 0;
  json out = json::array();
  for (std::size_t d = 0; d < p.history.size(); ++d) {
    auto points = p.history[d].points(since);
    json t = json::array(), a = json::array(), r = json::array(), l = json::array();
    for (const auto& pt : points) {
      t.push_back(pt.time_ns);
      a.push_back(pt.allocated);
      r.push_back(pt.reserved);
      l.push_back(pt.largest_free);
    }
    out.push_back({{"device", d},
                   {"time_ns", std::move(t)},
                   {"allocated", std::move(a)},
                   {"reserved", std::move(r)},
                   {"largest_free", std::move(l)}});
  }
  return out;
}
}  // namespace

std::string handle_request(std::string_view line, const Peer& peer, const ProcessTable& table,
                           const DaemonConfig& config) {
  try {
    std::string why;
    auto req = parse_request(line, &why);
    if (!req) return json{{"ok", false}, {"error", why}}.dump() + "\n";
    bool all = peer_sees_all(peer, config.admin_group);
    auto visible = [&](const TrackedProcess& p) { return all || p.name().uid == peer.uid; };
    json out{{"ok", true}};
    switch (req->cmd) {
      case Command::ping:
        out["version"] = GPUSTITCH_VERSION;
        out["pid"] = ::getpid();
        break;
      case Command::list: {
        json list = json::array();
        for (const auto& [pid, p] : table.processes())
          if (p.have_snapshot && visible(p))
            list.push_back(process_summary_json(
                p, req->summary ? shm::JsonDetail::summary : shm::JsonDetail::counters,
                &table.gpus()));
        out["processes"] = std::move(list);
        out["sample_interval_ms"] = config.sample_interval_ms;
        break;
      }
      case Command::show: {
        const TrackedProcess* p = table.find(req->pid);
        if (!p || !p->have_snapshot || !visible(*p))
          return json{{"ok", false}, {"error", "not found"}}.dump() + "\n";
        out["process"] = process_detail_json(*p, &table.gpus());
        out["history"] = history_json(*p, req->history_seconds);
        out["sample_interval_ms"] = config.sample_interval_ms;
        break;
      }
      case Command::status: {
        const PassStats& s = table.last_pass();
        std::size_t n = 0;
        for (const auto& [pid, p] : table.processes()) n += visible(p) ? 1 : 0;
        out["tracked"] = n;
        out["passes"] = table.passes();
        // The pass figures count every user's records: only for those who may see them all.
        if (!all) break;
        out["last_pass"] = {{"discovered", s.discovered}, {"tracked", s.tracked},
                            {"exited", s.exited},         {"reaped", s.reaped},
                            {"rejected", s.rejected},     {"busy", s.busy},
                            {"examined", s.examined},     {"over_quota", s.over_quota},
                            {"wall_ns", s.wall_ns},       {"cpu_ns", s.cpu_ns}};
        break;
      }
    }
    return out.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  } catch (const std::exception& e) {
    return json{{"ok", false}, {"error", std::string("internal error: ") + e.what()}}.dump() + "\n";
  }
}

}  // namespace gpustitch::daemon
