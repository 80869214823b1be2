// Helpers of the replay tests: a trace event, and one replay of a trace through a registered
// policy on a simulated device of a given capacity.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include "gpustitch/trace/trace_reader.h"
#include "policy.h"
#include "replayer.h"

namespace gpustitch::replay::test {

// An event with cudaFree semantics (no stream); set .stream for a stream-ordered one.
inline trace::TraceEvent event(trace::TraceAction a, std::uint64_t ptr, std::uint64_t size) {
  trace::TraceEvent e;
  e.action = a;
  e.ptr = ptr;
  e.size = size;
  e.stream = kAnyStream;
  return e;
}

// The counter named name in a replay's counters; a test failure where the policy has none.
inline std::uint64_t counter(const std::vector<std::pair<std::string, std::uint64_t>>& counters,
                             std::string_view name) {
  const auto value = find_counter(counters, name);
  if (!value) ADD_FAILURE() << "no counter " << name;
  return value.value_or(0);
}

inline ReplayResult replay_with(const std::string& name, const trace::Trace& t,
                                std::size_t capacity) {
  PolicyEnv env;
  env.devices = t.device_count();
  env.capacity = capacity;
  const PolicySpec* spec = find_policy(name);
  EXPECT_NE(spec, nullptr) << name;
  if (spec == nullptr) return {};
  std::string why;
  auto policy = spec->make(env, &why);
  EXPECT_NE(policy, nullptr) << why;
  if (policy == nullptr) return {};
  return replay_trace(t, *policy);
}

}  // namespace gpustitch::replay::test
