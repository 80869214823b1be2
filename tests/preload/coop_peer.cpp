// A CUDA program for the cooperative-release tests (coop_test.cpp), run under LD_PRELOAD on a
// shared simulated device. It reads one command per line on stdin and answers with one line:
//   alloc MB      -> "alloc rc=R id=I us=T": cudaMalloc MB MiB (taking T microseconds) and
//                    stamp the block with its id
//   free I        -> "free rc=R"
//   check         -> "check ok=1|0": every live block still holds its stamp (first/middle/last
//                    byte of each page the test touched)
//   events        -> "events give=N give_bytes=B give_peer=P receive=N receive_bytes=B
//                    receive_peer=P": coop events in this process's own statistics record
//   counters      -> "counters asks=.. requests=.. dropped=.. given=.. gives=.. received=.."
//   pid           -> "pid P"
//   exit
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cuda_decls.h"
#include "gpustitch/shm/names.h"
#include "gpustitch/shm/record_reader.h"

namespace {

struct Live {
  unsigned char* p;
  std::size_t size;
};
std::map<int, Live> g_live;
int g_next = 0;

void stamp(const Live& b, unsigned char v) {
  for (std::size_t off = 0; off < b.size; off += 1 << 20) {
    b.p[off] = v;
    b.p[off + (1 << 19)] = v;
    b.p[off + (1 << 20) - 1] = v;
  }
}
bool stamped(const Live& b, unsigned char v) {
  for (std::size_t off = 0; off < b.size; off += 1 << 20) {
    if (b.p[off] != v || b.p[off + (1 << 19)] != v || b.p[off + (1 << 20) - 1] != v) return false;
  }
  return true;
}

std::optional<gpustitch::shm::RecordReader> own_record() {
  using namespace gpustitch::shm;
  for (const RecordName& n : discover_records(kDefaultPrefix, ::geteuid())) {
    if (n.pid != ::getpid()) continue;
    ReadError err{};
    if (auto r = RecordReader::open(n, ::geteuid(), &err)) return r;
  }
  return std::nullopt;
}

}  // namespace

int main() {
  cudaSetDevice(0);
  std::string line;
  while (std::getline(std::cin, line)) {
    char cmd[32] = {};
    long arg = 0;
    std::sscanf(line.c_str(), "%31s %ld", cmd, &arg);
    const std::string c = cmd;
    if (c == "alloc") {
      void* p = nullptr;
      const std::size_t size = static_cast<std::size_t>(arg) << 20;
      const auto t0 = std::chrono::steady_clock::now();
      int rc = cudaMalloc(&p, size);
      const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::steady_clock::now() - t0)
                          .count();
      int id = -1;
      if (rc == 0) {
        id = g_next++;
        g_live[id] = {static_cast<unsigned char*>(p), size};
        stamp(g_live[id], static_cast<unsigned char>(0x40 + id));
      }
      std::printf("alloc rc=%d id=%d us=%lld\n", rc, id, static_cast<long long>(us));
    } else if (c == "free") {
      auto it = g_live.find(static_cast<int>(arg));
      int rc = it == g_live.end() ? -1 : cudaFree(it->second.p);
      if (it != g_live.end()) g_live.erase(it);
      std::printf("free rc=%d\n", rc);
    } else if (c == "check") {
      bool ok = true;
      for (auto& [id, b] : g_live) ok = ok && stamped(b, static_cast<unsigned char>(0x40 + id));
      std::printf("check ok=%d\n", ok ? 1 : 0);
    } else if (c == "events") {
      unsigned give = 0, receive = 0;
      unsigned long long give_bytes = 0, receive_bytes = 0, give_peer = 0, receive_peer = 0;
      std::vector<gpustitch::shm::EventCopy> events;
      if (auto r = own_record()) r->read_events(&events);
      for (const auto& e : events) {
        if (e.kind == gpustitch::shm::RecordEventKind::coop_give) {
          ++give, give_bytes += e.size, give_peer = e.peer_pid;
        } else if (e.kind == gpustitch::shm::RecordEventKind::coop_receive) {
          ++receive, receive_bytes += e.size, receive_peer = e.peer_pid;
        }
      }
      std::printf(
          "events give=%u give_bytes=%llu give_peer=%llu receive=%u receive_bytes=%llu "
          "receive_peer=%llu\n",
          give, give_bytes, give_peer, receive, receive_bytes, receive_peer);
    } else if (c == "counters") {
      gpustitch::shm::SnapshotCopy snap;
      auto r = own_record();
      // The counters are published every interval: wait for a fresh snapshot.
      ::usleep(300000);
      if (r && r->read_snapshot(&snap) == gpustitch::shm::ReadError::none &&
          !snap.devices.empty()) {
        const auto& d = snap.devices[0];
        std::printf(
            "counters asks=%llu requests=%llu dropped=%llu given=%llu gives=%llu received=%llu\n",
            (unsigned long long)d.coop_asks, (unsigned long long)d.coop_requests,
            (unsigned long long)d.coop_dropped, (unsigned long long)d.coop_given_bytes,
            (unsigned long long)d.coop_gives, (unsigned long long)d.coop_received_bytes);
      } else {
        std::printf("counters none\n");
      }
    } else if (c == "pid") {
      std::printf("pid %d\n", static_cast<int>(::getpid()));
    } else if (c == "exit") {
      break;
    } else {
      std::printf("unknown\n");
    }
    std::fflush(stdout);
  }
  for (auto& [id, b] : g_live) cudaFree(b.p);
  return 0;
}
