// The live-block table (core/src/block_table.h) against std::map: every block inserted is found
// under its address until taken, taking returns that block once, and addresses never inserted or
// already taken find nothing, across growth and long churn with 2 MiB-aligned addresses.
#include "block_table.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <vector>

using namespace gpustitch;
using gpustitch::detail::Block;
using gpustitch::detail::BlockTable;

TEST(BlockTable, MatchesAReferenceMapUnderRandomChurn) {
  BlockTable table(4);  // small, so that it grows several times
  std::map<DevPtr, Block*> model;
  std::vector<std::unique_ptr<Block>> blocks;
  std::mt19937_64 rng(7);
  // Addresses from a few dense ranges of 2 MiB steps, as views hand them out: many share the
  // same high bits, which is what makes probe chains collide.
  auto address = [&] {
    const DevPtr range = 0x7f0000000000ull + (rng() % 4) * (1ull << 36);
    return range + (rng() % 4096) * 2 * MiB;
  };
  for (int step = 0; step < 200000; ++step) {
    const DevPtr ptr = address();
    if (model.count(ptr) == 0 && (model.size() < 2000 && rng() % 2)) {
      blocks.push_back(std::make_unique<Block>());
      blocks.back()->ptr = ptr;
      table.insert(blocks.back().get());
      model[ptr] = blocks.back().get();
    } else {
      auto it = model.find(ptr);
      Block* expected = it == model.end() ? nullptr : it->second;
      ASSERT_EQ(table.find(ptr), expected) << "step " << step;
      ASSERT_EQ(table.take(ptr), expected) << "step " << step;
      ASSERT_EQ(table.find(ptr), nullptr) << "step " << step;
      if (it != model.end()) model.erase(it);
    }
    ASSERT_EQ(table.size(), model.size());
    if (step % 10000 == 0) {
      for (const auto& [p, b] : model) ASSERT_EQ(table.find(p), b) << "step " << step;
    }
  }
  for (const auto& [p, b] : model) ASSERT_EQ(table.take(p), b);
  EXPECT_TRUE(table.empty());
  EXPECT_EQ(table.take(0), nullptr);
}
