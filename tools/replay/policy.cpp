// The replay policy registry. See policy.h.
#include "policy.h"

namespace gpustitch::replay {

std::vector<PolicySpec>& policy_registry() {
  static std::vector<PolicySpec> specs;
  return specs;
}

PolicyRegistrar::PolicyRegistrar(std::string name, std::string description, bool default_on,
                                 PolicyFactory make) {
  policy_registry().push_back(
      {std::move(name), std::move(description), default_on, std::move(make)});
}

const PolicySpec* find_policy(const std::string& name) {
  for (const auto& s : policy_registry())
    if (s.name == name) return &s;
  return nullptr;
}

}  // namespace gpustitch::replay
