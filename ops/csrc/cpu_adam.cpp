// Fused one-pass Adam/AdamW step on the CPU: reads the fp32 master, exp_avg, exp_avg_sq and a fp32/bf16/fp16
// gradient once, writes the fp32 master and states, and optionally a low-precision copy of the updated master (the
// buffer that goes back to the accelerator). About 28 bytes per parameter, so it runs at memory speed.
//
// The AVX-512 and AVX2 kernels carry per-function target attributes and are chosen at run time, so the library is
// built for baseline x86-64 and runs on any host; a scalar kernel covers other CPUs. Every kernel performs the same
// floating-point operations in the same order (fma where the vector code uses fma), so all paths agree bit for bit.
// Headers are kept minimal (no torch/extension.h): the build is ~4x faster.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "cpu_adam_kernels.h"

namespace {

using Kernel = void (*)(const Bufs&, const Hyper&, int64_t, int64_t);

template <DT G, DT O>
Kernel pick_for(int64_t isa) {
#ifdef FZ_X86
  if (isa == kAVX512) return &adam_avx512<G, O>;
  if (isa == kAVX2) return &adam_avx2<G, O>;
#endif
  return &adam_scalar<G, O>;
}

template <DT G>
Kernel pick_out(DT o, int64_t isa) {
  switch (o) {
    case DT::F32: return pick_for<G, DT::F32>(isa);
    case DT::BF16: return pick_for<G, DT::BF16>(isa);
    default: return pick_for<G, DT::F16>(isa);
  }
}

DT to_dt(c10::ScalarType t, const char* what) {
  switch (t) {
    case c10::ScalarType::Float: return DT::F32;
    case c10::ScalarType::BFloat16: return DT::BF16;
    case c10::ScalarType::Half: return DT::F16;
    default: TORCH_CHECK(false, "fsdpzero::adam_step: ", what, " must be float32, bfloat16 or float16, got ", t);
  }
  return DT::F32;
}

void check_state(const at::Tensor& t, const char* what, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == c10::ScalarType::Float && t.is_contiguous(),
              "fsdpzero::adam_step: ", what, " must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.numel() == n, "fsdpzero::adam_step: ", what, " has ", t.numel(), " elements, param has ", n);
}

void run_adam(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
              const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out, const at::Tensor& param_in,
              const at::Tensor& exp_avg_in, const at::Tensor& exp_avg_sq_in, double lr, double beta1,
              double beta2, double eps, double weight_decay, int64_t step, bool adamw, bool bias_correction,
              double grad_scale, int64_t isa) {
  const int64_t n = param.numel();
  check_state(param, "param", n);
  check_state(exp_avg, "exp_avg", n);
  check_state(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == n,
              "fsdpzero::adam_step: grad must be a contiguous CPU tensor with the param's ", n, " elements");
  TORCH_CHECK(step >= 1, "fsdpzero::adam_step: step must be >= 1, got ", step);
  const DT gdt = to_dt(grad.scalar_type(), "grad");
  DT odt = DT::F32;
  void* out_ptr = nullptr;
  if (out.has_value()) {
    TORCH_CHECK(out->device().is_cpu() && out->is_contiguous() && out->numel() == n,
                "fsdpzero::adam_step: out must be a contiguous CPU tensor with the param's ", n, " elements");
    odt = to_dt(out->scalar_type(), "out");
    out_ptr = out->data_ptr();
  }
  const int64_t have = best_isa();
  TORCH_CHECK(isa <= have, "fsdpzero::adam_step: isa ", isa, " requested, this CPU supports up to ", have);
  if (isa < 0) isa = have;

  Hyper h;
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, double(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, double(step)) : 1.0;
  h.keep = adamw ? float(1.0 - lr * weight_decay) : 1.0f;
  h.l2 = adamw ? 0.0f : float(weight_decay);
  h.w1 = float(1.0 - beta1);
  h.beta2 = float(beta2);
  h.omb2 = float(1.0 - beta2);
  h.step_size = float(lr / bc1);
  h.bc2_sqrt = float(std::sqrt(bc2));
  h.eps = float(eps);
  h.grad_mul = float(grad_scale);

  Kernel k;
  switch (gdt) {
    case DT::F32: k = pick_out<DT::F32>(odt, isa); break;
    case DT::BF16: k = pick_out<DT::BF16>(odt, isa); break;
    default: k = pick_out<DT::F16>(odt, isa); break;
  }
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const float* pi = param_in.data_ptr<float>();
  const float* mi = exp_avg_in.data_ptr<float>();
  const float* vi = exp_avg_sq_in.data_ptr<float>();
  const bool in_place = p == pi && m == mi && v == vi;
  TORCH_CHECK(in_place || (p != pi && m != mi && v != vi),
              "fsdpzero::adam_step_into: the destination must not share storage with the source");
  auto aligned = [](const float* x) { return reinterpret_cast<uintptr_t>(x) % 64 == 0; };
  const Bufs b{p, grad.data_ptr(), m, v, out_ptr, pi, mi, vi,
               !in_place && aligned(p) && aligned(m) && aligned(v)};
  // Work in blocks of 1024 elements (4 KiB of fp32, whole cache lines); tensors under 32K elements stay on one thread.
  constexpr int64_t kBlock = 1024;
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, nblocks, 32, [&](int64_t b0, int64_t b1) {
    k(b, h, b0 * kBlock, std::min(n, b1 * kBlock));
  });
}

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out, double lr, double beta1,
               double beta2, double eps, double weight_decay, int64_t step, bool adamw, bool bias_correction,
               double grad_scale, int64_t isa) {
  run_adam(param, grad, exp_avg, exp_avg_sq, out, param, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay,
           step, adamw, bias_correction, grad_scale, isa);
}

// The same step, reading the master and states from *_in and writing the results to param/exp_avg/exp_avg_sq.
void adam_step_into(const at::Tensor& param_in, const at::Tensor& grad, const at::Tensor& exp_avg_in,
                    const at::Tensor& exp_avg_sq_in, const at::Tensor& param, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out, double lr, double beta1,
                    double beta2, double eps, double weight_decay, int64_t step, bool adamw, bool bias_correction,
                    double grad_scale, int64_t isa) {
  const int64_t n = param.numel();
  check_state(param_in, "param_in", n);
  check_state(exp_avg_in, "exp_avg_in", n);
  check_state(exp_avg_sq_in, "exp_avg_sq_in", n);
  run_adam(param, grad, exp_avg, exp_avg_sq, out, param_in, exp_avg_in, exp_avg_sq_in, lr, beta1, beta2, eps,
           weight_decay, step, adamw, bias_correction, grad_scale, isa);
}

// Sum of squares of a fp32/bf16/fp16 CPU tensor, accumulated in fp32 per 1024-element block and across blocks in
// double, in block order: the same bits for any thread count. The offload path's grad norm of CPU-resident bf16
// grads (offload_param): torch's foreach norm of bf16 returns a bf16 norm, and asking it for fp32 first converts the
// whole tensor (5x the memory traffic); this reads the 2 bytes once.
template <DT G>
double sumsq_block(const void* g, int64_t lo, int64_t hi, int64_t isa) {
  int64_t i = lo;
  float acc = 0.f;
#ifdef FZ_X86
  if (isa == kAVX512) return sumsq_block_avx512<G>(g, lo, hi);
  if (isa == kAVX2) return sumsq_block_avx2<G>(g, lo, hi);
#endif
  for (; i < hi; ++i) {
    float x = load_grad<G>(g, i);
    acc = std::fma(x, x, acc);
  }
  return acc;
}

double grad_sumsq(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "fsdpzero::grad_sumsq: needs a contiguous CPU tensor");
  const DT dt = to_dt(t.scalar_type(), "tensor");
  const int64_t n = t.numel(), isa = best_isa();
  constexpr int64_t kBlock = 1024;
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  std::vector<double> part(nblocks);
  const void* g = t.data_ptr();
  at::parallel_for(0, nblocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
      part[b] = dt == DT::F32 ? sumsq_block<DT::F32>(g, lo, hi, isa)
              : dt == DT::BF16 ? sumsq_block<DT::BF16>(g, lo, hi, isa) : sumsq_block<DT::F16>(g, lo, hi, isa);
    }
  });
  double total = 0.0;
  for (double x : part) total += x;
  return total;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fsdpzero, m) {
  m.def("adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!)? out, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, int step, bool adamw, "
        "bool bias_correction, float grad_scale, int isa) -> ()");
  m.def("adam_step_into(Tensor param_in, Tensor grad, Tensor exp_avg_in, Tensor exp_avg_sq_in, Tensor(a!) param, "
        "Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!)? out, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, int step, bool adamw, bool bias_correction, float grad_scale, int isa) -> ()");
  m.def("adam_best_isa() -> int", &best_isa);
  m.def("grad_sumsq(Tensor t) -> float", &grad_sumsq);
}

TORCH_LIBRARY_IMPL(fsdpzero, CPU, m) {
  m.impl("adam_step", &adam_step);
  m.impl("adam_step_into", &adam_step_into);
}
