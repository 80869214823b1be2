// Pod and container of a process from its cgroup path. See kube_cgroup.h.
#include "kube_cgroup.h"

#include <string>
#include <vector>

#include "daemon_config.h"

namespace gpustitch::daemon {
namespace {

bool is_hex(std::string_view s) {
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return !s.empty();
}

// A pod UID as the kubelet writes it: 8-4-4-4-12 lower-case hex (or with '_' for '-' in systemd
// slice names). Returns it with dashes, or "".
std::string pod_uid(std::string_view s) {
  if (s.size() != 36) return {};
  std::string out(s);
  for (std::size_t i = 0; i < out.size(); ++i) {
    bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash) {
      if (out[i] != '-' && out[i] != '_') return {};
      out[i] = '-';
    } else if (!is_hex(out.substr(i, 1))) {
      return {};
    }
  }
  return out;
}

// A container id segment: "<64 hex>" (cgroupfs) or "<runtime>-<64 hex>.scope" (systemd).
std::string container_id(std::string_view seg) {
  if (seg.size() > 6 && seg.substr(seg.size() - 6) == ".scope") {
    seg.remove_suffix(6);
    std::size_t dash = seg.rfind('-');
    if (dash == std::string_view::npos) return {};
    std::string_view runtime = seg.substr(0, dash);
    // conmon (CRI-O's monitor) shares the container's id but is not the container.
    if (runtime.find("conmon") != std::string_view::npos) return {};
    seg = seg.substr(dash + 1);
  }
  return seg.size() == 64 && is_hex(seg) ? std::string(seg) : std::string();
}

// The pod UID in a path segment, or "": "pod<uid>" (cgroupfs) or
// "[<root>-]kubepods[-<qos>]-pod<uid>.slice" (systemd).
std::string pod_segment(std::string_view seg) {
  if (seg.size() > 6 && seg.substr(seg.size() - 6) == ".slice") {
    seg.remove_suffix(6);
    if (seg.find("kubepods") == std::string_view::npos) return {};
    std::size_t at = seg.rfind("-pod");
    if (at == std::string_view::npos) return {};
    return pod_uid(seg.substr(at + 4));
  }
  if (seg.rfind("pod", 0) != 0) return {};
  return pod_uid(seg.substr(3));
}

std::optional<KubeIdentity> parse_path(std::string_view path) {
  std::vector<std::string_view> segs;
  while (!path.empty()) {
    std::size_t slash = path.find('/');
    std::string_view seg = path.substr(0, slash);
    if (!seg.empty()) segs.push_back(seg);
    path = slash == std::string_view::npos ? std::string_view{} : path.substr(slash + 1);
  }
  bool under_kubepods = false;
  for (std::size_t i = 0; i < segs.size(); ++i) {
    // "kubepods", "kubepods.slice", "kubepods-burstable.slice", or with a --cgroup-root prefix
    // ("kubelet-kubepods.slice", as kind makes them).
    if (segs[i].find("kubepods") != std::string_view::npos) under_kubepods = true;
    if (!under_kubepods) continue;
    std::string uid = pod_segment(segs[i]);
    if (uid.empty()) continue;
    KubeIdentity k{uid, {}};
    if (i + 1 < segs.size()) k.container_id = container_id(segs[i + 1]);
    return k;
  }
  return std::nullopt;
}

}  // namespace

std::optional<KubeIdentity> parse_kube_cgroup(std::string_view text) {
  // cgroup v2's unified line ("0::PATH") first, then any v1 hierarchy: on a hybrid system both
  // name the same pod, and a v1 line of a controller the kubelet does not manage may be "/".
  std::optional<KubeIdentity> v1;
  while (!text.empty()) {
    std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    std::size_t c1 = line.find(':');
    std::size_t c2 = c1 == std::string_view::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string_view::npos) continue;
    auto k = parse_path(line.substr(c2 + 1));
    if (!k) continue;
    if (line.substr(0, c2 + 1) == "0::") return k;
    // Prefer a line that names the container too (the v1 "pids" or "memory" line does).
    if (!v1 || (v1->container_id.empty() && !k->container_id.empty())) v1 = std::move(k);
  }
  return v1;
}

std::optional<KubeIdentity> read_kube_identity(pid_t pid, const std::string& proc_dir) {
  std::string text, why;
  if (!read_bounded_file(proc_dir + "/" + std::to_string(pid) + "/cgroup", 64 << 10, &text, &why))
    return std::nullopt;
  return parse_kube_cgroup(text);
}

}  // namespace gpustitch::daemon
