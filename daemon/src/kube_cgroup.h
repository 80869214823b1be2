// Which Kubernetes pod and container a process runs in, from its /proc/<pid>/cgroup, for the
// Prometheus labels pod_uid and container_id.
//
// The kubelet puts every container in a cgroup under "kubepods", named after the pod's UID and
// the container's runtime id. The shapes (cgroup v1: one line per hierarchy; v2: the single
// "0::" line), by kubelet cgroup driver:
//   cgroupfs: /kubepods[/burstable|/besteffort]/pod<uid>/<container id>
//   systemd:  /kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid, '-' as '_'>.slice/
//             <runtime>-<container id>.scope        (runtime: cri-containerd, crio, docker)
// (with a kubelet --cgroup-root, as kind sets it, the slices carry its prefix:
// "kubelet-kubepods-besteffort-pod<uid>.slice"). A reader in another cgroup namespace (gpustitchd
// in its own pod) sees the path relative to its own root ("/../../kubepods-..."), so the segments
// are matched wherever they appear.
//
// What is not in the cgroup: the pod's name and namespace and the container's name. dcgm-exporter
// asks the kubelet's pod-resources socket for those; gpustitchd does not (the environment of the
// process would be a user's word, and the labels must not be). Join with kube-state-metrics:
//   gpustitch_reserved_bytes * on (pod_uid) group_left (namespace, pod)
//     label_replace(kube_pod_info, "pod_uid", "$1", "uid", "(.*)")
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>

namespace gpustitch::daemon {

struct KubeIdentity {
  std::string pod_uid;       // "0b5f3a1e-9a7c-4d2b-8e1f-2a3b4c5d6e7f"
  std::string container_id;  // the runtime's id, 64 lower-case hex digits; "" when not in the path
};

// The pod and container of a /proc/<pid>/cgroup text, or nullopt when it is not under kubepods.
std::optional<KubeIdentity> parse_kube_cgroup(std::string_view cgroup_text);

// Reads /proc/<pid>/cgroup (bounded) and parses it.
std::optional<KubeIdentity> read_kube_identity(pid_t pid, const std::string& proc_dir = "/proc");

}  // namespace gpustitch::daemon
