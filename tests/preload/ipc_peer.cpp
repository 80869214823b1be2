// The importing process of the CUDA IPC tests (ipc_test.cpp), run under LD_PRELOAD (or without
// it, as a program without gpustitch). One command per line on stdin, one answer line on stdout:
//   open HEX [driver]  -> "rc PTR": cudaIpcOpenMemHandle (cuIpcOpenMemHandle with "driver") of
//                         the 64-byte handle HEX (128 hex digits); PTR in hex
//   check BYTE LEN     -> "1" if the LEN bytes at the opened pointer all are BYTE, else "0"
//   fill BYTE LEN      -> "ok": writes them
//   close [driver]     -> "rc": cudaIpcCloseMemHandle (cuIpcCloseMemHandle) of the pointer
//   exit
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>

#include "cuda_decls.h"

int main() {
  cudaSetDevice(0);
  unsigned char* ptr = nullptr;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd, arg, mode;
    in >> cmd;
    if (cmd == "open") {
      in >> arg >> mode;
      IpcHandle h{};
      for (std::size_t i = 0; i < sizeof h.reserved && 2 * i + 1 < arg.size(); ++i) {
        h.reserved[i] = static_cast<char>(std::stoi(arg.substr(2 * i, 2), nullptr, 16));
      }
      int rc;
      if (mode == "driver") {
        CUdeviceptr d = 0;
        rc = cuIpcOpenMemHandle_v2(&d, h, 1);
        if (rc == 0) ptr = reinterpret_cast<unsigned char*>(d);
      } else {
        void* p = nullptr;
        rc = cudaIpcOpenMemHandle(&p, h, 1);  // cudaIpcMemLazyEnablePeerAccess, as PyTorch
        if (rc == 0) ptr = static_cast<unsigned char*>(p);
      }
      std::printf("%d %p\n", rc, static_cast<void*>(ptr));
    } else if (cmd == "check" || cmd == "fill") {
      int byte = 0;
      std::size_t len = 0;
      in >> byte >> len;
      if (cmd == "fill") {
        std::memset(ptr, byte, len);
        std::printf("ok\n");
      } else {
        bool same = true;
        for (std::size_t i = 0; i < len; ++i) same = same && ptr[i] == byte;
        std::printf("%d\n", same ? 1 : 0);
      }
    } else if (cmd == "close") {
      in >> mode;
      int rc = mode == "driver" ? cuIpcCloseMemHandle(reinterpret_cast<CUdeviceptr>(ptr))
                                : cudaIpcCloseMemHandle(ptr);
      std::printf("%d\n", rc);
    } else if (cmd == "exit") {
      return 0;
    } else {
      std::printf("unknown\n");
    }
    std::fflush(stdout);
  }
  return 0;
}
