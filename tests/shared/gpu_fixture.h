// A made-up /proc/driver/nvidia/gpus for tests: one <bus id>/information file per GPU, in the
// driver's format, so that gpustitchd (nvidia_gpus_dir) and the CLI ($GPUSTITCH_NVIDIA_GPUS_DIR)
// name the GPUs of simulated devices as they name real ones.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace gpustitch::test {

struct FakeGpu {
  std::string bus_id;  // "0000:41:00.0"
  std::string uuid;    // "GPU-..."
  std::string model = "NVIDIA H200";
  int minor = 0;
};

// A fresh directory under /tmp holding the GPUs, removed when the fixture goes.
class GpuFixture {
 public:
  explicit GpuFixture(const std::vector<FakeGpu>& gpus) {
    char tmpl[] = "/tmp/gpustitch-gpus.XXXXXX";
    dir_ = ::mkdtemp(tmpl) ? tmpl : "";
    for (const auto& g : gpus) add(g);
  }
  ~GpuFixture() {
    if (!dir_.empty()) (void)!std::system(("rm -rf '" + dir_ + "'").c_str());
  }
  GpuFixture(const GpuFixture&) = delete;
  GpuFixture& operator=(const GpuFixture&) = delete;
  const std::string& dir() const { return dir_; }

  void add(const FakeGpu& g) {
    std::string d = dir_ + "/" + g.bus_id;
    ::mkdir(d.c_str(), 0755);
    std::ofstream(d + "/information")
        << "Model: \t\t " << g.model << "\nIRQ:   \t\t 0\nGPU UUID: \t " << g.uuid
        << "\nVideo BIOS: \t 96.00.74.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
        << "DMA Mask: \t 0xfffffffffffff\nBus Location: \t " << g.bus_id << "\nDevice Minor: \t "
        << g.minor << "\nGPU Firmware: \t 550.54.15\n"
        << "GPU Excluded:\t No\n";
  }

 private:
  std::string dir_;
};

}  // namespace gpustitch::test
