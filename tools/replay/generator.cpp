// generate_transformer_trace: see generator.h for the workload modelled.
#include "generator.h"

#include <cstdio>
#include <deque>

#include "gpustitch/trace/trace_writer.h"

namespace gpustitch::replay {

namespace {

// splitmix64: deterministic on every platform (std distributions are not).
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
};

class Builder {
 public:
  explicit Builder(trace::Trace& t) : t_(t) {}
  std::uint64_t alloc(std::uint64_t size) {
    std::uint64_t ptr = next_ptr_;
    next_ptr_ += align_up(size ? size : 1, 512) + 512;
    push(trace::TraceAction::allocate, ptr, size);
    return ptr;
  }
  void free(std::uint64_t ptr, std::uint64_t size) { push(trace::TraceAction::free, ptr, size); }

 private:
  void push(trace::TraceAction a, std::uint64_t ptr, std::uint64_t size) {
    trace::TraceEvent e;
    e.line = t_.events.size() + 2;
    e.thread = 1;
    e.time_s = 36000.0 + static_cast<double>(t_.events.size()) * 1e-5;
    e.action = a;
    e.ptr = ptr;
    e.size = size;
    e.stream = kAnyStream;
    e.device = 0;
    t_.events.push_back(e);
  }
  trace::Trace& t_;
  std::uint64_t next_ptr_ = 0x7f0000000000ull;
};

struct Tensor {
  std::uint64_t ptr, size;
};

}  // namespace

trace::Trace generate_transformer_trace(const TransformerTraceParams& p) {
  trace::Trace t;
  t.has_header = true;
  t.gpustitch_columns = true;
  Builder b(t);
  Rng rng{p.seed};
  const std::uint64_t h = p.hidden;

  // Parameters: embedding + per layer (qkv, out, mlp in, mlp out, 2 layer norms, biases).
  std::vector<std::uint64_t> param_sizes = {p.vocab * h * 2};
  for (int l = 0; l < p.layers; ++l) {
    for (std::uint64_t s : {3 * h * h * 2, h * h * 2, 4 * h * h * 2, 4 * h * h * 2, h * 2, h * 2,
                            3 * h * 2, 4 * h * 2})
      param_sizes.push_back(s);
  }
  for (std::uint64_t s : param_sizes) b.alloc(s);  // weights: live for the whole run
  std::vector<Tensor> grads, adam;
  std::deque<std::vector<Tensor>> kept;  // tensors kept for keep_steps steps

  double total_w = 0;
  for (double w : p.seq_weights) total_w += w;

  for (int step = 0; step < p.steps; ++step) {
    double pick = rng.uniform() * total_w;
    std::size_t li = 0;
    for (; li + 1 < p.seq_lengths.size(); ++li) {
      if (pick < p.seq_weights[li]) break;
      pick -= p.seq_weights[li];
    }
    const std::uint64_t L = p.seq_lengths[li];
    const std::uint64_t A = p.batch * L * h * 2;  // one fp16 activation
    const std::uint64_t stats = p.batch * 16 * L * 4;

    // Forward.
    std::vector<std::vector<Tensor>> saved(static_cast<std::size_t>(p.layers));
    auto keep_for_backward = [&](int layer, std::uint64_t size) {
      saved[static_cast<std::size_t>(layer)].push_back({b.alloc(size), size});
    };
    std::uint64_t ids = b.alloc(p.batch * L * 8);
    std::uint64_t x_size = A;
    Tensor x{b.alloc(x_size), x_size};  // embedding output
    for (int l = 0; l < p.layers; ++l) {
      keep_for_backward(l, A);      // ln1 out
      keep_for_backward(l, 3 * A);  // qkv
      keep_for_backward(l, stats);  // softmax statistics
      keep_for_backward(l, A);      // attention out
      std::uint64_t proj = b.alloc(A);
      saved[static_cast<std::size_t>(l)].push_back(x);  // residual input kept
      x = Tensor{b.alloc(A), A};
      b.free(proj, A);
      keep_for_backward(l, A);      // ln2 out
      keep_for_backward(l, 4 * A);  // mlp hidden
      keep_for_backward(l, 4 * A);  // gelu out
      std::uint64_t mlp_out = b.alloc(A);
      saved[static_cast<std::size_t>(l)].push_back(x);
      x = Tensor{b.alloc(A), A};
      b.free(mlp_out, A);
    }
    std::uint64_t logits_size = p.batch * L * p.vocab * 2;
    Tensor logits{b.alloc(logits_size), logits_size};
    std::uint64_t lse = b.alloc(p.batch * L * 4);
    std::uint64_t loss = b.alloc(4);

    // Tensors that outlive the step (hidden states for logging, per-length caches).
    std::vector<Tensor> keep;
    for (int k = 0; k < p.kept_per_step; ++k) {
      std::uint64_t size = k == 0 ? A : (k == 1 ? L * 128 * 4 : A / 4 + 4096 * k);
      keep.push_back({b.alloc(size), size});
    }
    kept.push_back(std::move(keep));

    // Backward.
    std::uint64_t probs = b.alloc(logits_size * 2);  // fp32 softmax grad
    b.free(logits.ptr, logits.size);
    Tensor dx{b.alloc(A), A};
    b.free(probs, logits_size * 2);
    b.free(lse, p.batch * L * 4);
    b.free(x.ptr, x.size);
    bool first = grads.empty();
    for (int l = p.layers - 1; l >= 0; --l) {
      std::uint64_t d_mlp = b.alloc(4 * A);
      std::uint64_t d_gelu = b.alloc(4 * A);
      b.free(d_mlp, 4 * A);
      std::uint64_t d_attn = b.alloc(3 * A);
      b.free(d_gelu, 4 * A);
      Tensor ndx{b.alloc(A), A};
      b.free(d_attn, 3 * A);
      b.free(dx.ptr, dx.size);
      dx = ndx;
      for (auto it = saved[static_cast<std::size_t>(l)].rbegin();
           it != saved[static_cast<std::size_t>(l)].rend(); ++it)
        b.free(it->ptr, it->size);
      if (first) {
        for (std::size_t i = 0; i < 8; ++i) {
          std::uint64_t s = param_sizes[1 + static_cast<std::size_t>(l) * 8 + i];
          grads.push_back({b.alloc(s), s});
        }
      }
    }
    if (first) grads.push_back({b.alloc(param_sizes[0]), param_sizes[0]});
    b.free(dx.ptr, dx.size);
    b.free(ids, p.batch * L * 8);
    b.free(loss, 4);

    // Optimizer: Adam states (fp32, twice the fp16 parameter) once, small temporaries each step.
    if (adam.empty()) {
      for (std::uint64_t s : param_sizes) {
        adam.push_back({b.alloc(2 * s), 2 * s});
        adam.push_back({b.alloc(2 * s), 2 * s});
      }
    }
    for (std::size_t i = 0; i < param_sizes.size(); i += 8) {
      std::uint64_t s = param_sizes[i] * 2;
      std::uint64_t tmp = b.alloc(s);
      b.free(tmp, s);
    }

    // Release what was kept keep_steps steps ago.
    if (static_cast<int>(kept.size()) > p.keep_steps) {
      for (const Tensor& k : kept.front()) b.free(k.ptr, k.size);
      kept.pop_front();
    }
  }
  for (const auto& ks : kept)
    for (const Tensor& k : ks) b.free(k.ptr, k.size);
  for (const Tensor& g : grads) b.free(g.ptr, g.size);
  for (const Tensor& a : adam) b.free(a.ptr, a.size);
  return t;
}

void write_trace_csv(const trace::Trace& t, std::ostream& out) {
  out << trace::kTraceHeader << "\n";
  char buf[64];
  for (const auto& e : t.events) {
    double tod = e.time_s;
    auto secs = static_cast<std::uint64_t>(tod);
    auto micros = static_cast<std::uint64_t>((tod - static_cast<double>(secs)) * 1e6 + 0.5);
    if (micros >= 1000000) {
      secs += 1;
      micros -= 1000000;
    }
    std::snprintf(buf, sizeof buf, "%02llu:%02llu:%02llu.%06llu",
                  static_cast<unsigned long long>(secs / 3600 % 24),
                  static_cast<unsigned long long>(secs / 60 % 60),
                  static_cast<unsigned long long>(secs % 60),
                  static_cast<unsigned long long>(micros));
    out << e.thread << ',' << buf << ','
        << (e.action == trace::TraceAction::allocate ? "allocate" : "free") << ",0x" << std::hex
        << e.ptr << std::dec << ',' << e.size << ",0x" << std::hex << e.stream << std::dec << ','
        << e.device << ',';
    if (e.served_by) {
      switch (*e.served_by) {
        case ServedBy::cache:
          out << "cache";
          break;
        case ServedBy::fresh:
          out << "fresh";
          break;
        case ServedBy::stitched:
          out << "stitched";
          break;
        case ServedBy::small:
          out << "small";
          break;
      }
    }
    out << '\n';
  }
}

}  // namespace gpustitch::replay
