// A synthetic trace of transformer training with dynamic sequence length, the workload of the
// seed articles (sequence length jumping between 256 and 8192). Used by CI until traces recorded
// on a GPU are in the repository, and by `gpustitch replay --generate`.
//
// Each step picks a sequence length L (mostly short, sometimes the longest, so memory use jumps)
// and runs:
//   forward:  per layer, activations saved for backward (proportional to L) and temporaries
//             freed at once; the logits (b*L*vocab) at the end;
//   keep:     a few L-sized tensors that outlive the step by `keep_steps` steps (hidden states
//             kept for logging / a teacher, a rotary cache for this L): allocated after the
//             forward pass, so a caching allocator places them inside the large blocks that the
//             activations just used, and they pin those blocks after the step;
//   backward: per layer in reverse, gradient temporaries, then the layer's activations freed;
//             parameter gradients (allocated once, at the first step) stay;
//   optimizer: small per-parameter temporaries.
// Pointers are unique synthetic addresses; all events are on device 0, stream kAnyStream (the
// cudaMalloc/cudaFree calls PyTorch makes with PYTORCH_NO_CUDA_MEMORY_CACHING=1).
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

#include "gpustitch/trace/trace_reader.h"

namespace gpustitch::replay {

struct TransformerTraceParams {
  int steps = 120;
  int layers = 12;
  std::size_t batch = 2;
  std::size_t hidden = 1024;
  std::size_t vocab = 32000;
  std::vector<std::size_t> seq_lengths = {256, 512, 1024, 2048, 4096, 8192};
  // Relative frequency of each sequence length (same order).
  std::vector<double> seq_weights = {30, 20, 15, 10, 6, 4};
  int keep_steps = 3;     // how long the kept tensors outlive their step
  int kept_per_step = 3;  // tensors kept per step
  std::uint64_t seed = 42;
};

trace::Trace generate_transformer_trace(const TransformerTraceParams& params);

// Writes a trace in gpustitch's RMM CSV format (header, then one line per event).
void write_trace_csv(const trace::Trace& trace, std::ostream& out);

}  // namespace gpustitch::replay
