// Chooses and creates the backend a Config asks for.
#pragma once

#include <memory>
#include <string>

#include "gpustitch/backend.h"
#include "gpustitch/config.h"
#include "gpustitch/cuda_backend.h"

namespace gpustitch {

// backend:cuda -> the CUDA driver (null and *why set if it cannot load); backend:sim -> the
// simulated device described by the sim_* keys; backend:auto -> CUDA when a driver and a VMM
// capable device are present, else null with *why (callers decide whether to fall back to sim,
// as the demo does, or to run natively, as the preload shim does).
std::unique_ptr<Backend> make_backend(const Config& config, std::string* why,
                                      DriverResolver resolver = nullptr,
                                      void* resolver_context = nullptr);

std::unique_ptr<Backend> make_sim_backend(const Config& config);

}  // namespace gpustitch
