// Pool pins and physical layouts (pool_pins.cpp, physical_layout.cpp), the core's part of CUDA IPC
// on pool memory: a pinned block freed by the program is not reused until its last unpin, and the
// layout names the handles that really back a block.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "gpustitch/pool.h"
#include "gpustitch/sim_backend.h"
#include "test_device.h"

using namespace gpustitch;

namespace {

struct FreedSeen {
  std::vector<DevPtr> bases;
};
void record_free(DevPtr base, void* context) noexcept {
  static_cast<FreedSeen*>(context)->bases.push_back(base);
}

TEST(PoolPins, APinnedBlockFreedStaysOutOfReuseUntilTheLastUnpin) {
  TestDevice dev = make_test_device();
  Pool pool(*dev.backend, inline_config());
  FreedSeen seen;
  pool.set_pinned_free_handler(&record_free, &seen);
  for (std::size_t size : {std::size_t{8} * MiB, std::size_t{4096}}) {
    DevPtr p = 0;
    ASSERT_EQ(pool.allocate(0, size, kAnyStream, &p), Status::ok);
    const std::uint64_t held = pool.stats(0).bytes_allocated;
    ASSERT_EQ(pool.pin(p), Status::ok);
    ASSERT_EQ(pool.pin(p), Status::ok);  // two importers
    EXPECT_EQ(pool.deallocate(p), Status::ok);
    ASSERT_EQ(seen.bases.size(), 1u);
    EXPECT_EQ(seen.bases.back(), p);
    EXPECT_FALSE(pool.find(p));
    EXPECT_EQ(pool.deallocate(p), Status::invalid_value);  // a second free
    EXPECT_EQ(pool.pin(p), Status::invalid_value);         // freed: nothing to pin any more
    EXPECT_EQ(pool.stats(0).bytes_allocated, held);
    pool.drain_pending(0);
    std::vector<DevPtr> more(16);
    for (DevPtr& q : more) {
      ASSERT_EQ(pool.allocate(0, size, kAnyStream, &q), Status::ok);
      EXPECT_NE(q, p);
    }
    for (DevPtr q : more) ASSERT_EQ(pool.deallocate(q), Status::ok);
    pool.unpin(p);
    EXPECT_EQ(pool.stats(0).bytes_allocated, held);  // one importer left
    pool.unpin(p);
    EXPECT_LT(pool.stats(0).bytes_allocated, held);  // freed now
    EXPECT_EQ(pool.validate(0), "");
    seen.bases.clear();
  }
}

TEST(PoolPins, PinningNeedsTheBaseOfALiveBlockAndUnpinningALiveBlockKeepsIt) {
  TestDevice dev = make_test_device();
  Pool pool(*dev.backend, inline_config());
  DevPtr p = 0;
  ASSERT_EQ(pool.allocate(0, 4 * MiB, kAnyStream, &p), Status::ok);
  EXPECT_EQ(pool.pin(p + 4096), Status::invalid_value);
  EXPECT_EQ(pool.pin(12345), Status::invalid_value);
  ASSERT_EQ(pool.pin(p), Status::ok);
  pool.unpin(p);
  EXPECT_TRUE(pool.find(p));
  EXPECT_EQ(pool.deallocate(p), Status::ok);
  EXPECT_FALSE(pool.find(p));
}

TEST(PhysicalLayout, NamesTheHandlesBehindTheBlock) {
  TestDevice dev = make_test_device();
  if (dev.sim == nullptr) GTEST_SKIP() << "reads the handles through the simulated backend";
  Pool pool(*dev.backend, inline_config());
  for (std::size_t size : {std::size_t{24} * MiB, std::size_t{1000}}) {
    DevPtr p = 0;
    ASSERT_EQ(pool.allocate(0, size, kAnyStream, &p), Status::ok);
    std::vector<unsigned char> bytes(size);
    for (std::size_t i = 0; i < size; ++i) bytes[i] = static_cast<unsigned char>(i * 13 + 1);
    dev.write(p, bytes.data(), size);
    PhysicalLayout layout;
    ASSERT_EQ(pool.physical_layout(p + size / 2, &layout), Status::ok);
    EXPECT_EQ(layout.device, 0);
    EXPECT_LE(layout.base, p);
    EXPECT_EQ(layout.base + layout.offset, p);
    EXPECT_GE(layout.size, layout.offset + size);
    // The same bytes through a second mapping of exactly those handles, side by side.
    DevPtr range = 0;
    ASSERT_EQ(dev.backend->reserve(0, layout.size, &range), Status::ok);
    DevPtr at = range;
    for (const auto& piece : layout.pieces) {
      ASSERT_EQ(dev.backend->map(at, piece.size, piece.handle, 0), Status::ok);
      at += piece.size;
    }
    EXPECT_EQ(at - range, layout.size);
    const int devices[] = {0};
    ASSERT_EQ(dev.backend->set_access(range, layout.size, devices), Status::ok);
    EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(range + layout.offset), bytes.data(), size),
              0);
    at = range;
    for (const auto& piece : layout.pieces) {
      ASSERT_EQ(dev.backend->unmap(at, piece.size), Status::ok);
      at += piece.size;
    }
    ASSERT_EQ(dev.backend->unreserve(range, layout.size), Status::ok);
    ASSERT_EQ(pool.deallocate(p), Status::ok);
  }
  PhysicalLayout layout;
  EXPECT_EQ(pool.physical_layout(4096, &layout), Status::invalid_value);
}

TEST(SimBackendSharing, AnImportedHandleMapsTheExportersMemoryAndCountsNothing) {
  SimBackend exporter, importer;
  PhysHandle h = 0;
  ASSERT_EQ(exporter.create(0, 4 * MiB, &h), Status::ok);
  DevPtr a = 0;
  ASSERT_EQ(exporter.reserve(0, 4 * MiB, &a), Status::ok);
  ASSERT_EQ(exporter.map(a, 4 * MiB, h, 0), Status::ok);
  const int devices[] = {0};
  ASSERT_EQ(exporter.set_access(a, 4 * MiB, devices), Status::ok);
  std::memset(reinterpret_cast<void*>(a), 0x42, 4 * MiB);
  int fd = -1;
  ASSERT_EQ(exporter.export_handle(h, &fd), Status::ok);
  PhysHandle imported = 0;
  ASSERT_EQ(importer.import_handle(0, fd, 4 * MiB, &imported), Status::ok);
  close(fd);
  EXPECT_EQ(importer.used(0), 0u);
  DevPtr b = 0;
  ASSERT_EQ(importer.reserve(0, 4 * MiB, &b), Status::ok);
  ASSERT_EQ(importer.map(b, 4 * MiB, imported, 0), Status::ok);
  ASSERT_EQ(importer.set_access(b, 4 * MiB, devices), Status::ok);
  EXPECT_EQ(static_cast<unsigned char*>(reinterpret_cast<void*>(b))[4 * MiB - 1], 0x42);
  static_cast<unsigned char*>(reinterpret_cast<void*>(b))[0] = 0x24;
  EXPECT_EQ(static_cast<unsigned char*>(reinterpret_cast<void*>(a))[0], 0x24);
  ASSERT_EQ(importer.unmap(b, 4 * MiB), Status::ok);
  ASSERT_EQ(importer.release(imported), Status::ok);
  EXPECT_EQ(importer.used(0), 0u);
  ASSERT_EQ(importer.unreserve(b, 4 * MiB), Status::ok);
  EXPECT_EQ(importer.import_handle(0, -1, 4 * MiB, &imported), Status::invalid_value);
  EXPECT_EQ(exporter.unmap(a, 4 * MiB), Status::ok);
  EXPECT_EQ(exporter.release(h), Status::ok);
  EXPECT_EQ(exporter.unreserve(a, 4 * MiB), Status::ok);
}

}  // namespace
