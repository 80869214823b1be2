// The pod and container of a process from /proc/<pid>/cgroup (daemon/src/kube_cgroup.h), on
// cgroup files as nodes write them: cgroup v1 and v2, the kubelet's cgroupfs and systemd drivers,
// containerd, CRI-O and Docker, a reader in another cgroup namespace, and paths that only look
// like a pod's.
#include "kube_cgroup.h"

#include <gtest/gtest.h>
#include <unistd.h>

namespace gpustitch::daemon {
namespace {

const std::string kUid = "6c5d1f8a-3b1e-4c4e-9d36-2f0b6a1d9e7c";
const std::string kUidUnderscores = "6c5d1f8a_3b1e_4c4e_9d36_2f0b6a1d9e7c";
const std::string kId = "3f5b7c1e9d2a4b6c8e0f1a3b5c7d9e1f3a5b7c9d1e3f5a7b9c1d3e5f7a9b1c3d";

void expect_pod(const std::string& text, const std::string& container) {
  auto k = parse_kube_cgroup(text);
  ASSERT_TRUE(k) << text;
  EXPECT_EQ(k->pod_uid, kUid) << text;
  EXPECT_EQ(k->container_id, container) << text;
}

// cgroup v1, kubelet cgroupfs driver (Docker or containerd): every hierarchy names the pod.
TEST(KubeCgroup, V1CgroupfsBurstable) {
  std::string p = "/kubepods/burstable/pod" + kUid + "/" + kId;
  expect_pod("12:pids:" + p + "\n11:hugetlb:" + p + "\n10:memory:" + p + "\n9:devices:" + p +
                 "\n8:cpu,cpuacct:" + p + "\n1:name=systemd:" + p + "\n0::/\n",
             kId);
}

// Guaranteed pods sit directly under kubepods.
TEST(KubeCgroup, V1CgroupfsGuaranteed) {
  expect_pod("4:memory:/kubepods/pod" + kUid + "/" + kId + "\n", kId);
}

// cgroup v1, systemd driver, containerd: the UID's dashes are underscores in the slice name.
TEST(KubeCgroup, V1SystemdContainerd) {
  std::string p = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" +
                  kUidUnderscores + ".slice/cri-containerd-" + kId + ".scope";
  expect_pod("13:misc:/\n12:memory:" + p + "\n11:pids:" + p + "\n1:name=systemd:" + p + "\n", kId);
}

// cgroup v2, systemd driver (the default on current distributions): one "0::" line.
TEST(KubeCgroup, V2SystemdContainerdBestEffort) {
  expect_pod("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" +
                 kUidUnderscores + ".slice/cri-containerd-" + kId + ".scope\n",
             kId);
}

TEST(KubeCgroup, V2SystemdGuaranteedCrio) {
  expect_pod(
      "0::/kubepods.slice/kubepods-pod" + kUidUnderscores + ".slice/crio-" + kId + ".scope\n", kId);
}

TEST(KubeCgroup, V2SystemdDocker) {
  expect_pod("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" +
                 kUidUnderscores + ".slice/docker-" + kId + ".scope\n",
             kId);
}

TEST(KubeCgroup, V2Cgroupfs) {
  expect_pod("0::/kubepods/besteffort/pod" + kUid + "/" + kId + "\n", kId);
}

// A kubelet with --cgroup-root (kind): the slices carry the root's prefix.
TEST(KubeCgroup, V2WithCgroupRootPrefix) {
  expect_pod(
      "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
      "kubelet-kubepods-besteffort-pod" +
          kUidUnderscores + ".slice/cri-containerd-" + kId + ".scope\n",
      kId);
}

// gpustitchd in its own pod reads other processes' paths relative to its cgroup namespace.
TEST(KubeCgroup, V2SeenFromAnotherCgroupNamespace) {
  expect_pod("0::/../../kubepods-burstable-pod" + kUidUnderscores + ".slice/cri-containerd-" + kId +
                 ".scope\n",
             kId);
}

// The pod's own cgroup (a process in the pod cgroup itself, or CRI-O's conmon next to the
// container): the pod is known, the container is not.
TEST(KubeCgroup, PodWithoutContainer) {
  expect_pod("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" +
                 kUidUnderscores + ".slice\n",
             "");
  expect_pod("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" +
                 kUidUnderscores + ".slice/crio-conmon-" + kId + ".scope\n",
             "");
}

// On a hybrid system the v2 line is the kubelet's; a v1 line that names the container wins over
// one that does not.
TEST(KubeCgroup, PrefersTheLineThatNamesTheContainer) {
  expect_pod("3:cpuset:/kubepods/burstable/pod" + kUid + "\n2:memory:/kubepods/burstable/pod" +
                 kUid + "/" + kId + "\n",
             kId);
}

TEST(KubeCgroup, NotInAPod) {
  EXPECT_FALSE(parse_kube_cgroup("0::/user.slice/user-1000.slice/session-3.scope\n"));
  EXPECT_FALSE(parse_kube_cgroup("0::/system.slice/docker-" + kId + ".scope\n"));
  EXPECT_FALSE(parse_kube_cgroup("0::/\n"));
  EXPECT_FALSE(parse_kube_cgroup("12:memory:/user.slice\n11:pids:/user.slice\n"));
  EXPECT_FALSE(parse_kube_cgroup(""));
}

// Paths that only look like a pod's: a "pod<uid>" outside kubepods (any user can make such a
// cgroup under a delegated subtree), a malformed UID, a container id of the wrong shape.
TEST(KubeCgroup, LookalikesAreRejected) {
  EXPECT_FALSE(parse_kube_cgroup("0::/user.slice/user-1000.slice/pod" + kUid + "/" + kId + "\n"));
  EXPECT_FALSE(parse_kube_cgroup("0::/kubepods/burstable/podnot-a-uid/" + kId + "\n"));
  EXPECT_FALSE(parse_kube_cgroup("0::/kubepods/burstable/pod" + kUid + "x/" + kId + "\n"));
  EXPECT_FALSE(
      parse_kube_cgroup("0::/kubepods/burstable/pod6C5D1F8A-3B1E-4C4E-9D36-2F0B6A1D9E7C/x\n"));
  expect_pod("0::/kubepods/burstable/pod" + kUid + "/" + kId.substr(1) + "\n", "");
  expect_pod("0::/kubepods/burstable/pod" + kUid + "/cri-containerd-" + kId + "\"\n.scope", "");
  EXPECT_FALSE(parse_kube_cgroup("garbage without colons\n\n::\n"));
}

// This test process itself: not in a pod on the build machine, and reading it does not fail.
TEST(KubeCgroup, ReadsAProcess) {
  auto k = read_kube_identity(::getpid());
  if (k) {
    EXPECT_EQ(k->pod_uid.size(), 36u);
  }
  EXPECT_FALSE(read_kube_identity(::getpid(), "/nonexistent"));
}

}  // namespace
}  // namespace gpustitch::daemon
