#include "gpustitch/stats.h"

#include <bit>

namespace gpustitch {

int histogram_bucket(std::size_t size) noexcept {
  if (size < 1024) return 0;
  int log2 = std::bit_width(size) - 1;  // floor(log2(size)), >= 10
  int bucket = log2 - 9;
  return bucket >= kHistogramBuckets ? kHistogramBuckets - 1 : bucket;
}

}  // namespace gpustitch
