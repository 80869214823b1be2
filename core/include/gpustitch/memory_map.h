// The pool's memory map: its mapped address ranges and the blocks in them, as a memory snapshot
// shows them (`gpustitch snapshot PID` writes it in the format of PyTorch's memory_viz).
//
// Built on request from the pool's own bookkeeping (Pool::memory_map), so the allocation path
// keeps no second table of live blocks for it.
#pragma once

#include <cstdint>
#include <vector>

#include "gpustitch/types.h"

namespace gpustitch {

struct MappedBlock {
  enum class State : std::uint8_t {
    live,     // allocated to the program
    free,     // cached, reusable by any allocation
    pending,  // freed, waiting for the device work queued before the free (or for its stream)
  };
  DevPtr ptr = 0;
  std::size_t size = 0;       // bytes the block spans
  std::size_t requested = 0;  // live: bytes the program asked for
  State state = State::free;
  Stream stream = kAnyStream;  // live: the stream it was allocated on; pending: freed on
};

struct MappedSegment {
  int device = 0;
  DevPtr base = 0;
  std::size_t size = 0;
  bool stitched = false;  // physical memory of several handles mapped side by side
  bool small = false;     // a chunk of the small-object pool, cut into equal slots
  Stream stream = kAnyStream;
  std::vector<MappedBlock> blocks;  // in address order, covering [base, base + size)
};

}  // namespace gpustitch
