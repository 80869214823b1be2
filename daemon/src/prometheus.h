// Prometheus text exposition (format 0.0.4) of every tracked process, with dcgm-exporter's labels
// (gpu, UUID, device, modelName, Hostname): one series per process and GPU, the GPU's own figures
// (free and total memory) once per GPU. The metric names and labels are those of
// gpustitch/shm/metrics.h.
#pragma once

#include <string>

#include "process_table.h"

namespace gpustitch::daemon {

std::string format_prometheus(const ProcessTable& table);

// A label value as the exposition format needs it: backslash, double quote and newline escaped,
// every byte that is not part of well-formed UTF-8 replaced by U+FFFD.
std::string escape_label(std::string_view value);

}  // namespace gpustitch::daemon
