// The daemon's floor and cross-user relay for cooperative release. See coop_relay.h.
#include "coop_relay.h"

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

namespace gpustitch::daemon {
using nlohmann::json;

namespace {
constexpr std::uint64_t kFloorRoundNs = 1'000'000'000;  // one floor round per GPU per second
constexpr double kRelaysPerSecond = 4.0;                // per asking uid (burst the same)
constexpr std::size_t kMaxFloorChecks = 8;              // membership checks per GPU per round

bool has_uuid(const shm::DeviceCounters& d, const Uuid& uuid) {
  return std::memcmp(d.uuid, uuid.data(), uuid.size()) == 0;
}
bool zero_uuid(const shm::DeviceCounters& d) {
  for (auto b : d.uuid)
    if (b != 0) return false;
  return true;
}
}  // namespace

std::vector<CoopTarget> plan_release(const std::map<pid_t, TrackedProcess>& processes,
                                     const Uuid& uuid, std::uint64_t wanted,
                                     std::optional<uid_t> exclude_uid, pid_t exclude_pid) {
  std::vector<CoopTarget> out;
  for (const auto& [pid, p] : processes) {
    if (!p.have_snapshot || pid == exclude_pid) continue;
    if (exclude_uid && p.name().uid == *exclude_uid) continue;
    for (const auto& d : p.snapshot.devices) {
      if (has_uuid(d, uuid) && d.releasable_bytes() > 0) {
        out.push_back({pid, p.name().start_time, p.name().uid, d.releasable_bytes()});
        break;
      }
    }
  }
  std::sort(out.begin(), out.end(),
            [](const CoopTarget& a, const CoopTarget& b) { return a.bytes > b.bytes; });
  std::uint64_t remaining = wanted;
  std::size_t n = 0;
  for (; n < out.size() && remaining > 0; ++n) {
    out[n].bytes = std::min(out[n].bytes, remaining);
    remaining -= out[n].bytes;
  }
  out.resize(n);
  return out;
}

std::vector<std::pair<Uuid, std::uint64_t>> gpus_below_floor(
    const std::map<pid_t, TrackedProcess>& processes, std::uint64_t floor,
    const std::function<bool(pid_t, const Uuid&)>& trusted) {
  struct Report {
    std::uint64_t heartbeat = 0, free = 0;
    pid_t pid = 0;
  };
  std::map<Uuid, std::vector<Report>> gpus;
  for (const auto& [pid, p] : processes) {
    if (!p.have_snapshot) continue;
    for (const auto& d : p.snapshot.devices) {
      if (zero_uuid(d) || d.device_total == 0) continue;
      Uuid u;
      std::memcpy(u.data(), d.uuid, u.size());
      gpus[u].push_back({p.snapshot.heartbeat_ns, d.device_free, pid});
    }
  }
  std::vector<std::pair<Uuid, std::uint64_t>> out;
  for (auto& [u, reports] : gpus) {
    // The freshest report from a process really on that GPU: a made-up record can neither
    // trigger releases (low free) nor hide a real shortage (high free, fresher heartbeat).
    std::sort(reports.begin(), reports.end(),
              [](const Report& a, const Report& b) { return a.heartbeat > b.heartbeat; });
    std::size_t checked = 0;
    for (const Report& r : reports) {
      if (trusted && (checked++ >= kMaxFloorChecks || !trusted(r.pid, u))) continue;
      if (r.free < floor) out.emplace_back(u, floor - r.free);
      break;
    }
  }
  return out;
}

CoopRelay::CoopRelay(std::unique_ptr<GpuMembership> membership)
    : socket_(coop::Socket::ephemeral()),
      membership_(membership ? std::move(membership) : std::make_unique<DriverMembership>()) {}

int CoopRelay::send(const std::vector<CoopTarget>& targets, const Uuid& uuid, pid_t origin) {
  if (!socket_) return 0;
  int sent = 0;
  for (const CoopTarget& t : targets) {
    coop::Message m;
    m.kind = coop::Kind::request;
    m.id = next_id_++;
    std::memcpy(m.uuid, uuid.data(), uuid.size());
    m.bytes = t.bytes;
    m.origin_pid = origin;
    if (socket_->send_to(t.pid, t.start_time, m)) ++sent;
  }
  return sent;
}

void CoopRelay::drain_replies() {
  if (!socket_) return;
  while (auto r = socket_->receive(0)) {
    if (r->message && r->message->kind == coop::Kind::reply &&
        r->message->status == coop::ReplyStatus::ok) {
      released_ += r->message->bytes;
    }
  }
}

void CoopRelay::after_sample(const ProcessTable& table, const DaemonConfig& config) {
  drain_replies();
  if (config.coop_floor_mb == 0) return;
  const std::uint64_t floor = std::uint64_t{config.coop_floor_mb} << 20;
  const std::uint64_t now = coop::monotonic_ns();
  auto trusted = [this](pid_t pid, const Uuid& uuid) {
    return membership_->on_gpu(pid, uuid).value_or(false);
  };
  for (const auto& [uuid, missing] : gpus_below_floor(table.processes(), floor, trusted)) {
    auto it = last_floor_ns_.find(uuid);
    if (it != last_floor_ns_.end() && now - it->second < kFloorRoundNs) continue;
    last_floor_ns_[uuid] = now;
    auto targets = plan_release(table.processes(), uuid, missing);
    if (targets.empty()) continue;
    int sent = send(targets, uuid, 0);
    floor_requests_ += static_cast<std::uint64_t>(sent);
    spdlog::debug("coop floor: a GPU is {} MiB below the floor; asked {} process(es)",
                  missing >> 20, sent);
  }
}

std::optional<std::string> CoopRelay::handle(std::string_view line, const Peer& peer,
                                             const ProcessTable& table, const DaemonConfig&) {
  if (line.size() > kMaxRequestBytes || line.find("coop_release") == std::string_view::npos) {
    return std::nullopt;
  }
  json j = json::parse(line.begin(), line.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  auto cmd = j.find("cmd");
  if (cmd == j.end() || !cmd->is_string() || cmd->get_ref<const std::string&>() != "coop_release")
    return std::nullopt;
  auto fail = [](const char* why) { return json{{"ok", false}, {"error", why}}.dump() + "\n"; };
  auto u = j.find("uuid");
  auto b = j.find("bytes");
  if (u == j.end() || !u->is_string() || b == j.end() || !b->is_number_unsigned())
    return fail("\"coop_release\" needs \"uuid\" (string) and \"bytes\" (unsigned)");
  auto uuid = parse_uuid(u->get_ref<const std::string&>());
  const std::uint64_t bytes = b->get<std::uint64_t>();
  if (!uuid || bytes == 0 || bytes > coop::kMaxBytes) return fail("bad \"uuid\" or \"bytes\"");
  // Only a process really on that GPU may ask: the kernel says who the peer is.
  const TrackedProcess* asker = table.find(peer.pid);
  bool on_gpu = false;
  if (asker != nullptr && asker->have_snapshot && asker->name().uid == peer.uid) {
    for (const auto& d : asker->snapshot.devices) on_gpu = on_gpu || has_uuid(d, *uuid);
  }
  if (!on_gpu) return fail("not found");
  // The record says so, but the asker wrote its record: ask the driver (gpu_membership.h).
  std::optional<bool> really = membership_->on_gpu(peer.pid, *uuid);
  if (!really) {
    ++unverified_;
    return fail("cannot verify that the asker is on that GPU");
  }
  if (!*really) {
    ++refused_;
    if (refused_ == 1 || refused_ % 100 == 0)
      spdlog::warn(
          "coop relay: pid {} (uid {}) claims a GPU the driver does not show it on ({} "
          "refused so far)",
          peer.pid, peer.uid, refused_);
    return fail("not found");
  }
  auto bucket = relay_buckets_.try_emplace(peer.uid, kRelaysPerSecond, kRelaysPerSecond).first;
  if (!bucket->second.take(coop::monotonic_ns())) return fail("rate limited");
  auto targets = plan_release(table.processes(), *uuid, bytes, peer.uid, peer.pid);
  const int sent = send(targets, *uuid, peer.pid);
  relayed_requests_ += static_cast<std::uint64_t>(sent);
  std::uint64_t planned = 0;
  for (const auto& t : targets) planned += t.bytes;
  return json{{"ok", true}, {"asked", sent}, {"bytes", planned}}.dump() + "\n";
}

}  // namespace gpustitch::daemon
