// The node's GPUs as the NVIDIA driver lists them, so that readers of the records can name the
// GPU a process uses: a record says which GPU by UUID (cuDeviceGetUuid), and its device ordinal
// is the process's own (CUDA_VISIBLE_DEVICES=2 makes physical GPU 2 the process's device 0), so
// neither tells an operator "GPU 2, NVIDIA H200".
//
// Source: /proc/driver/nvidia/gpus/<PCI bus id>/information, one directory per GPU, written by
// the kernel driver (readable by every user, and inside containers). It gives the model name, the
// UUID and the device minor (/dev/nvidia<minor>). The index is the GPU's rank in PCI bus id
// order, the order in which NVML, nvidia-smi and dcgm-exporter number GPUs (CUDA numbers them
// fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, which is why the record's ordinal is not it).
//
// What is not there: MIG instances (their UUIDs start with "MIG-" and have no directory) and
// simulated devices; for them find() returns null and readers show the UUID alone. Part of
// gpustitch_shm_json (gpustitchd and the CLI), not of the preload library.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpustitch/shm/record.h"

namespace gpustitch::shm {

inline constexpr const char* kDriverGpusDir = "/proc/driver/nvidia/gpus";

struct GpuInfo {
  int index = -1;                               // rank in PCI bus id order (nvidia-smi's index)
  std::string name;                             // "Model:", e.g. "NVIDIA H200"
  std::string bus_id;                           // "Bus Location:" (else the directory name)
  int minor = -1;                               // "Device Minor:", -1 when absent
  std::array<std::uint8_t, kUuidBytes> uuid{};  // "GPU UUID:"
};

class GpuInventory {
 public:
  GpuInventory() = default;
  // Reads every <dir>/<bus id>/information (each at most 64 KiB; unreadable or UUID-less entries
  // are skipped). A missing directory gives an empty inventory.
  static GpuInventory read(const std::string& dir = kDriverGpusDir);
  // Parses one information file's text; false when it names no valid GPU UUID.
  static bool parse_information(std::string_view text, GpuInfo* out);

  // The GPU with this UUID, or null (all-zero UUID, MIG instance, simulated device, no driver).
  const GpuInfo* find(const std::uint8_t (&uuid)[kUuidBytes]) const;
  const GpuInfo* find(const std::array<std::uint8_t, kUuidBytes>& uuid) const;
  const std::vector<GpuInfo>& gpus() const { return gpus_; }  // in index order

 private:
  std::vector<GpuInfo> gpus_;
};

// The directory the CLI reads: $GPUSTITCH_NVIDIA_GPUS_DIR (tests point it at a fixture), else
// kDriverGpusDir. gpustitchd takes its own from its configuration (nvidia_gpus_dir).
std::string gpus_dir_from_environment();

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (or without "GPU-") -> bytes; false when malformed.
bool parse_uuid_text(std::string_view text, std::array<std::uint8_t, kUuidBytes>* out);

}  // namespace gpustitch::shm
