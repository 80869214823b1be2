// The StatsPublisher constructor that reads a Pool. Kept apart so that programs using another
// StatsSource (tests, tools) do not need the allocator core linked in.
#include "gpustitch/pool.h"
#include "gpustitch/shm/publisher.h"

namespace gpustitch::shm {

StatsPublisher::StatsPublisher(const gpustitch::Pool& pool, const gpustitch::Config& config,
                               PublisherOptions options) noexcept
    : StatsPublisher(StatsSource{[&pool] { return pool.device_count(); },
                                 [&pool](int d) { return pool.stats(d); }},
                     config, std::move(options)) {}

}  // namespace gpustitch::shm
