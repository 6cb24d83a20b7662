// Fused Adam / AdamW step on CPU tensors: one pass over memory per element.
//
// For every element of every tensor in the lists, in one loop: read the gradient (times
// grad_scale, negated for maximize), the parameter and both moments; apply weight decay
// (decoupled for AdamW, L2 for Adam), update the moments and the parameter; write the
// parameter, the moments and, where asked, a copy of the updated parameter in another dtype
// (the copy the next all-gather sends). Arithmetic is in float32 for every storage dtype
// (float32, bfloat16, float16), each operation rounded as in torch.optim.AdamW's
// single-tensor path (built with -ffp-contract=off: no multiply-add is fused into an FMA
// except the lerp's, which torch's vectorized lerp computes with one too). torch's scalar
// tail loops round the lerp in two steps, so results agree with torch within float32
// rounding (an ulp here and there), not bit for bit.
//
// The vector width is the compiler's: built with -O3 -march=native, the loop is
// auto-vectorized for the build machine (AVX-512, AVX2 or SSE); vector_isa() says which.
// Every operation is an IEEE one (multiply, add, fma, sqrt, divide), so the vector body and
// the scalar tail give each element the same bits: an element's result does not depend on
// where it lies in a tensor, how the tensors are cut into work items or how many threads run.
//
// Scheduling: the tensors of a call are one virtual flat range (their elements end to end);
// it is cut into work items of kBlock elements, which may span several small tensors, so a
// call over thousands of small shards costs what one flat buffer of their size costs. The
// threads (torch's intra-op count, fewer for a small call) take items from a shared counter
// rather than a fixed half each: on a machine shared with other processes a thread that is
// descheduled delays the step by the item it holds, not by its whole half.
//
// The step is bound by memory bandwidth, not arithmetic: it moves 28 bytes per float32
// element (reads p, g, m, v; writes p, m, v), and on the machines measured a kernel that
// moves the same bytes with no arithmetic (p += g, m += g, v += g) is no faster
// (benchmarks/README.md, optimizer_step.py).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 1 << 15;         // elements per work item (128 KiB of each float32 stream)
constexpr int64_t kMinPerThread = 1 << 16;  // a call of fewer elements per thread runs on fewer threads

struct Coefficients {
  float lr_decay;       // AdamW: parameter multiplier 1 - lr * weight_decay
  float l2;             // Adam: weight_decay added to the gradient times the parameter
  float one_minus_b1;   // exp_avg += (1 - beta1) * (g - exp_avg)
  float beta2;
  float one_minus_b2;
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float grad_scale;     // multiplies every gradient as it is read (clip coefficient, 1/loss scale)
};

// Loads and stores in float32 arithmetic. bfloat16 is converted by integer shifts and
// round-to-nearest-even on the bits (what c10::BFloat16 does, NaN to 0x7FC0), which the
// compiler vectorizes; float16 by c10::Half's scalar code (about 6x torch's fused kernel:
// float16 master weights are rare, ZeroOptimizer keeps float32 masters for param_dtype fp16).
inline float load(float x) { return x; }
inline float store(float x, float*) { return x; }

inline float load(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline c10::BFloat16 store(float f, c10::BFloat16*) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  c10::BFloat16 out;
  out.x = (f != f) ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  return out;
}

inline float load(c10::Half x) { return static_cast<float>(x); }
inline c10::Half store(float f, c10::Half*) { return static_cast<c10::Half>(f); }

template <typename P, typename C, bool kL2>
void update_range(P* __restrict__ param, const P* __restrict__ grad, P* __restrict__ exp_avg,
                  P* __restrict__ exp_avg_sq, C* __restrict__ copy, int64_t begin, int64_t end,
                  const Coefficients c, bool maximize) {
  const float sign = maximize ? -c.grad_scale : c.grad_scale;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float p = load(param[i]);
    float g = load(grad[i]) * sign;
    if (kL2) g = std::fma(c.l2, p, g);  // Adam: L2 penalty in the gradient (contracted, as torch's)
    p = p * c.lr_decay;          // AdamW: decoupled decay (1 when there is none)
    float m = load(exp_avg[i]);
    m = std::fma(c.one_minus_b1, g - m, m);     // exp_avg.lerp_(grad, 1 - beta1): an FMA, as torch's
    float v = load(exp_avg_sq[i]) * c.beta2;      // exp_avg_sq.mul_(beta2)
    v = std::fma(c.one_minus_b2 * g, g, v);      //   .addcmul_(grad, grad, value=1 - beta2), contracted
    const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
    p = p + (c.neg_step_size * m) / denom;        // param.addcdiv_(exp_avg, denom, value=-step_size)
    param[i] = store(p, param);
    exp_avg[i] = store(m, exp_avg);
    exp_avg_sq[i] = store(v, exp_avg_sq);
    if constexpr (!std::is_void_v<C>) copy[i] = store(p, copy);
  }
}

template <typename P, bool kL2>
void update_with_copy(P* p, const P* g, P* m, P* v, const at::Tensor* copy, int64_t begin, int64_t end,
                      const Coefficients& c, bool maximize) {
  if (copy == nullptr) {
    update_range<P, void, kL2>(p, g, m, v, nullptr, begin, end, c, maximize);
    return;
  }
  switch (copy->scalar_type()) {
    case at::kFloat:
      update_range<P, float, kL2>(p, g, m, v, copy->data_ptr<float>(), begin, end, c, maximize);
      break;
    case at::kBFloat16:
      update_range<P, c10::BFloat16, kL2>(p, g, m, v, copy->data_ptr<c10::BFloat16>(), begin, end, c, maximize);
      break;
    case at::kHalf:
      update_range<P, c10::Half, kL2>(p, g, m, v, copy->data_ptr<c10::Half>(), begin, end, c, maximize);
      break;
    default:
      TORCH_CHECK(false, "fused_adam: copy dtype must be float32, bfloat16 or float16");
  }
}

template <typename P>
void update_tensor_range(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const at::Tensor* copy, int64_t begin,
                         int64_t end, const Coefficients& c, bool maximize) {
  P* p = param.data_ptr<P>();
  const P* g = grad.data_ptr<P>();
  P* m = exp_avg.data_ptr<P>();
  P* v = exp_avg_sq.data_ptr<P>();
  if (c.l2 != 0.0f) {
    update_with_copy<P, true>(p, g, m, v, copy, begin, end, c, maximize);
  } else {
    update_with_copy<P, false>(p, g, m, v, copy, begin, end, c, maximize);
  }
}

void check_tensor(const at::Tensor& t, const at::Tensor& like, const char* what, int64_t index) {
  TORCH_CHECK(t.device().is_cpu(), "fused_adam: ", what, "[", index, "] is not a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "fused_adam: ", what, "[", index, "] is not contiguous");
  TORCH_CHECK(t.numel() == like.numel(), "fused_adam: ", what, "[", index, "] has ", t.numel(),
              " elements, the parameter ", like.numel());
}

}  // namespace

// The step's coefficients for a tensor at step `step` (already incremented).
Coefficients coefficients(double step, double lr, double beta1, double beta2, double eps, double weight_decay,
                          bool decoupled, double grad_scale) {
  const double bc1 = 1.0 - std::pow(beta1, step);
  const double bc2 = 1.0 - std::pow(beta2, step);
  Coefficients c;
  c.lr_decay = static_cast<float>(decoupled ? 1.0 - lr * weight_decay : 1.0);
  c.l2 = static_cast<float>(decoupled ? 0.0 : weight_decay);
  c.one_minus_b1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_b2 = static_cast<float>(1.0 - beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-lr / bc1);
  c.grad_scale = static_cast<float>(grad_scale);
  return c;
}

// One Adam/AdamW step on every tensor of the lists (all the same length; copies may be empty).
// Each steps[i] is a 0-dim float32 tensor: incremented here, then used for bias correction.
// bump_versions: increment the autograd version counter of every tensor written (what an
// in-place torch op does); the torch.library op that wraps this call does it itself.
void adam_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
               std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
               std::vector<at::Tensor> steps, std::vector<at::Tensor> copies, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool decoupled,
               bool maximize, double grad_scale, bool bump_versions) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "fused_adam: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length");
  TORCH_CHECK(copies.empty() || copies.size() == n, "fused_adam: copies must be empty or one per parameter");
  std::vector<Coefficients> coef(n);
  std::vector<int64_t> offset(n + 1, 0);   // tensor i's first element in the virtual flat range
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const auto dtype = p.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "fused_adam: params[", i, "] has dtype ", dtype, "; float32, bfloat16 or float16 only");
    TORCH_CHECK(p.device().is_cpu() && p.is_contiguous(), "fused_adam: params[", i,
                "] must be a contiguous CPU tensor");
    check_tensor(grads[i], p, "grads", i);
    check_tensor(exp_avgs[i], p, "exp_avgs", i);
    check_tensor(exp_avg_sqs[i], p, "exp_avg_sqs", i);
    TORCH_CHECK(grads[i].scalar_type() == dtype && exp_avgs[i].scalar_type() == dtype &&
                    exp_avg_sqs[i].scalar_type() == dtype,
                "fused_adam: grads, exp_avgs and exp_avg_sqs [", i, "] must have the parameter's dtype");
    if (!copies.empty()) {
      check_tensor(copies[i], p, "copies", i);
      const auto copy_dtype = copies[i].scalar_type();
      TORCH_CHECK(copy_dtype == at::kFloat || copy_dtype == at::kBFloat16 || copy_dtype == at::kHalf,
                  "fused_adam: copy dtype must be float32, bfloat16 or float16");
    }
    at::Tensor& step_t = steps[i];
    TORCH_CHECK(step_t.numel() == 1 && step_t.scalar_type() == at::kFloat && step_t.device().is_cpu(),
                "fused_adam: steps[", i, "] must be a 1-element float32 CPU tensor");
    float* step_ptr = step_t.data_ptr<float>();
    *step_ptr += 1.0f;
    const float step = *step_ptr;
    // the tensors of a group are usually at the same step: two pow() per tensor add up over thousands
    const bool same_step = i > 0 && step == *steps[i - 1].data_ptr<float>();
    coef[i] = same_step ? coef[i - 1]
                        : coefficients(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale);
    offset[i + 1] = offset[i] + p.numel();
  }

  // Update elements [begin, end) of tensor t.
  auto update_piece = [&](size_t t, int64_t begin, int64_t end) {
    const at::Tensor* copy = copies.empty() ? nullptr : &copies[t];
    switch (params[t].scalar_type()) {
      case at::kFloat:
        update_tensor_range<float>(params[t], grads[t], exp_avgs[t], exp_avg_sqs[t], copy, begin, end, coef[t],
                                   maximize);
        break;
      case at::kBFloat16:
        update_tensor_range<c10::BFloat16>(params[t], grads[t], exp_avgs[t], exp_avg_sqs[t], copy, begin, end,
                                           coef[t], maximize);
        break;
      default:
        update_tensor_range<c10::Half>(params[t], grads[t], exp_avgs[t], exp_avg_sqs[t], copy, begin, end,
                                       coef[t], maximize);
    }
  };
  const int64_t total = offset[n];
  const int64_t items = (total + kBlock - 1) / kBlock;
  // Work item `item`: elements [item * kBlock, (item + 1) * kBlock) of the flat range, in
  // however many tensors they lie.
  auto run_item = [&](int64_t item) {
    const int64_t lo = item * kBlock;
    const int64_t hi = std::min(lo + kBlock, total);
    // the last tensor starting at or before lo (offset[n] = total > lo): the one holding lo
    size_t t = std::upper_bound(offset.begin(), offset.end(), lo) - offset.begin() - 1;
    for (; t < n && offset[t] < hi; ++t) {
      const int64_t begin = std::max(lo, offset[t]) - offset[t];
      const int64_t end = std::min(hi, offset[t + 1]) - offset[t];
      if (begin < end) update_piece(t, begin, end);
    }
  };
  const int64_t threads = std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()), items,
                                             std::max<int64_t>(1, total / kMinPerThread)});
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t item = 0; item < items; ++item) run_item(item);
  } else {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t item = next.fetch_add(1, std::memory_order_relaxed); item < items;
           item = next.fetch_add(1, std::memory_order_relaxed)) {
        run_item(item);
      }
    });
  }
  if (bump_versions) {
    for (const auto* list : {&params, &exp_avgs, &exp_avg_sqs, &steps, &copies}) {
      for (const at::Tensor& t : *list) torch::autograd::impl::bump_version(t);
    }
  }
}

// The memory traffic of adam_step with no arithmetic to speak of: p += g, m += g, v += g on
// float32 tensors (reads four streams, writes three: 28 bytes per element), scheduled as
// adam_step is. benchmarks/optimizer_step.py times it as the floor of the step on the machine.
void memory_floor(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v) {
  for (const at::Tensor* t : {&p, &g, &m, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat &&
                    t->numel() == p.numel(),
                "memory_floor: four contiguous float32 CPU tensors of one size");
  }
  float* __restrict__ P = p.data_ptr<float>();
  const float* __restrict__ G = g.data_ptr<float>();
  float* __restrict__ M = m.data_ptr<float>();
  float* __restrict__ V = v.data_ptr<float>();
  const int64_t total = p.numel();
  const int64_t items = (total + kBlock - 1) / kBlock;
  auto run_item = [&](int64_t item) {
    const int64_t end = std::min((item + 1) * kBlock, total);
#pragma omp simd
    for (int64_t i = item * kBlock; i < end; ++i) {
      const float x = G[i];
      P[i] += x;
      M[i] += x;
      V[i] += x;
    }
  };
  const int64_t threads = std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()), items,
                                             std::max<int64_t>(1, total / kMinPerThread)});
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    for (int64_t item = next.fetch_add(1, std::memory_order_relaxed); item < items;
         item = next.fetch_add(1, std::memory_order_relaxed)) {
      run_item(item);
    }
  });
}

// The vector instruction set the compiler targeted for this build.
std::string vector_isa() {
#if defined(__AVX512F__)
  return "AVX512";
#elif defined(__AVX2__)
  return "AVX2";
#elif defined(__SSE2__)
  return "SSE2";
#elif defined(__ARM_NEON)
  return "NEON";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "Fused Adam/AdamW step over lists of contiguous CPU tensors",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("steps"),
        py::arg("copies"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("decoupled"), py::arg("maximize"), py::arg("grad_scale"),
        py::arg("bump_versions") = false);
  m.def("memory_floor", &memory_floor, "p += g, m += g, v += g: the step's memory traffic, no arithmetic");
  m.def("vector_isa", &vector_isa, "The vector instruction set this build targets");
}
