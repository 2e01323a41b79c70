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
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FZ_X86 1
#define FZ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define FZ_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

enum class DT : int { F32, BF16, F16 };
enum ISA : int64_t { kAuto = -1, kScalar = 0, kAVX2 = 1, kAVX512 = 2 };

// Per-call constants, already folded in double precision and rounded to float once.
struct Hyper {
  float keep;       // AdamW: 1 - lr * wd (decoupled decay), else 1
  float l2;         // Adam: wd, added to the gradient (L2), else 0
  float w1;         // 1 - beta1, the lerp weight of exp_avg toward the gradient
  float beta2;
  float omb2;       // 1 - beta2
  float step_size;  // lr / (1 - beta1^t), or lr without bias correction
  float bc2_sqrt;   // sqrt(1 - beta2^t), or 1
  float eps;
  float grad_mul;   // 1 / loss scale * clip coefficient, folded into the read of the gradient
};

struct Bufs {
  float* p;
  const void* g;
  float* m;
  float* v;
  void* out;  // nullptr: no low-precision copy
  // Where the step reads the master and states: p/m/v themselves (in place), or another set (adam_step_into, the
  // speculative step of the offload path, which must leave the live state untouched until it is committed).
  const float* pi;
  const float* mi;
  const float* vi;
  bool stream_state;  // out of place and aligned: write p/m/v with streaming stores (no read-for-ownership)
};

// ---------------------------------------------------------------- scalar (also the tail of the vector kernels)
template <DT G>
inline float load_grad(const void* g, int64_t i) {
  if constexpr (G == DT::F32) return static_cast<const float*>(g)[i];
  else if constexpr (G == DT::BF16) return float(static_cast<const c10::BFloat16*>(g)[i]);
  else return float(static_cast<const c10::Half*>(g)[i]);
}

template <DT O>
inline void store_out(void* o, int64_t i, float x) {
  if constexpr (O == DT::F32) static_cast<float*>(o)[i] = x;
  else if constexpr (O == DT::BF16) static_cast<c10::BFloat16*>(o)[i] = c10::BFloat16(x);  // round to nearest even
  else static_cast<c10::Half*>(o)[i] = c10::Half(x);
}

template <DT G, DT O>
inline void adam_scalar(const Bufs& b, const Hyper& h, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    float p = b.pi[i];
    float g = load_grad<G>(b.g, i) * h.grad_mul;
    g = std::fma(h.l2, p, g);
    p = p * h.keep;
    float m = std::fma(h.w1, g - b.mi[i], b.mi[i]);
    float v = std::fma(g * g, h.omb2, b.vi[i] * h.beta2);
    float denom = std::sqrt(v) / h.bc2_sqrt + h.eps;
    p = std::fma(-h.step_size, m / denom, p);
    b.p[i] = p;
    b.m[i] = m;
    b.v[i] = v;
    if (b.out) store_out<O>(b.out, i, p);
  }
}

#ifdef FZ_X86
// ---------------------------------------------------------------- AVX-512: 16 floats per vector
template <DT G>
FZ_AVX512 inline __m512 load_grad16(const void* g, int64_t i) {
  if constexpr (G == DT::F32) return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  else {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == DT::BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else return _mm512_cvtph_ps(h);
  }
}

// The low-precision copy is written once and next read by the H2D DMA, not by this CPU: aligned streaming
// stores skip the read-for-ownership of its cache lines (2 of ~30 bytes/param) and leave the cache to the states.
template <DT O>
FZ_AVX512 inline void store_out16(void* o, int64_t i, __m512 x, bool stream) {
  if constexpr (O == DT::F32) {
    if (stream) _mm512_stream_ps(static_cast<float*>(o) + i, x);
    else _mm512_storeu_ps(static_cast<float*>(o) + i, x);
  } else {
    __m256i h;
    if constexpr (O == DT::BF16) {  // same rounding as c10::BFloat16: nearest even, NaN -> 0x7fc0
      __m512i u = _mm512_castps_si512(x);
      __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
      h = _mm512_cvtepi32_epi16(r);
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    if (stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o) + i), h);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o) + i), h);
  }
}

// fp32 master/moment store; streaming when the step writes another buffer than it read (adam_step_into)
FZ_AVX512 inline void store_state16(float* d, __m512 x, bool stream) {
  if (stream) _mm512_stream_ps(d, x);
  else _mm512_storeu_ps(d, x);
}

template <DT G, DT O>
FZ_AVX512 void adam_avx512(const Bufs& b, const Hyper& h, int64_t lo, int64_t hi) {
  const __m512 keep = _mm512_set1_ps(h.keep), l2 = _mm512_set1_ps(h.l2), w1 = _mm512_set1_ps(h.w1);
  const __m512 beta2 = _mm512_set1_ps(h.beta2), omb2 = _mm512_set1_ps(h.omb2);
  const __m512 neg_step = _mm512_set1_ps(-h.step_size), bc2s = _mm512_set1_ps(h.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(h.eps), gmul = _mm512_set1_ps(h.grad_mul);
  const int64_t osize = O == DT::F32 ? 4 : 2;   // 16 lanes: 64 or 32 bytes, the streaming store's alignment
  const bool stream =
      b.out && reinterpret_cast<uintptr_t>(static_cast<char*>(b.out) + lo * osize) % (16 * osize) == 0;
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    __m512 p = _mm512_loadu_ps(b.pi + i);
    __m512 g = _mm512_mul_ps(load_grad16<G>(b.g, i), gmul);
    g = _mm512_fmadd_ps(l2, p, g);
    p = _mm512_mul_ps(p, keep);
    __m512 m = _mm512_loadu_ps(b.mi + i);
    m = _mm512_fmadd_ps(w1, _mm512_sub_ps(g, m), m);
    __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(g, g), omb2, _mm512_mul_ps(_mm512_loadu_ps(b.vi + i), beta2));
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2s), eps);
    p = _mm512_fmadd_ps(neg_step, _mm512_div_ps(m, denom), p);
    store_state16(b.p + i, p, b.stream_state);
    store_state16(b.m + i, m, b.stream_state);
    store_state16(b.v + i, v, b.stream_state);
    if (b.out) store_out16<O>(b.out, i, p, stream);
  }
  if (stream || b.stream_state) _mm_sfence();   // streaming stores are weakly ordered: visible before another
  adam_scalar<G, O>(b, h, i, hi);                // thread queues the H2D or commits the state
}

// ---------------------------------------------------------------- AVX2: 8 floats per vector
template <DT G>
FZ_AVX2 inline __m256 load_grad8(const void* g, int64_t i) {
  if constexpr (G == DT::F32) return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == DT::BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
}

template <DT O>
FZ_AVX2 inline void store_out8(void* o, int64_t i, __m256 x, bool stream) {
  if constexpr (O == DT::F32) {
    if (stream) _mm256_stream_ps(static_cast<float*>(o) + i, x);
    else _mm256_storeu_ps(static_cast<float*>(o) + i, x);
  } else {
    __m128i h;
    if constexpr (O == DT::BF16) {
      __m256i u = _mm256_castps_si256(x);
      __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
      __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
      // r holds 8 values < 2^16: pack to u16 (per 128-bit lane), then gather the two lanes' low halves.
      h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
    } else {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    if (stream) _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(o) + i), h);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(o) + i), h);
  }
}

FZ_AVX2 inline void store_state8(float* d, __m256 x, bool stream) {
  if (stream) _mm256_stream_ps(d, x);
  else _mm256_storeu_ps(d, x);
}

template <DT G, DT O>
FZ_AVX2 void adam_avx2(const Bufs& b, const Hyper& h, int64_t lo, int64_t hi) {
  const __m256 keep = _mm256_set1_ps(h.keep), l2 = _mm256_set1_ps(h.l2), w1 = _mm256_set1_ps(h.w1);
  const __m256 beta2 = _mm256_set1_ps(h.beta2), omb2 = _mm256_set1_ps(h.omb2);
  const __m256 neg_step = _mm256_set1_ps(-h.step_size), bc2s = _mm256_set1_ps(h.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(h.eps), gmul = _mm256_set1_ps(h.grad_mul);
  const int64_t osize = O == DT::F32 ? 4 : 2;   // 8 lanes: 32 or 16 bytes
  const bool stream =
      b.out && reinterpret_cast<uintptr_t>(static_cast<char*>(b.out) + lo * osize) % (8 * osize) == 0;
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 p = _mm256_loadu_ps(b.pi + i);
    __m256 g = _mm256_mul_ps(load_grad8<G>(b.g, i), gmul);
    g = _mm256_fmadd_ps(l2, p, g);
    p = _mm256_mul_ps(p, keep);
    __m256 m = _mm256_loadu_ps(b.mi + i);
    m = _mm256_fmadd_ps(w1, _mm256_sub_ps(g, m), m);
    __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(g, g), omb2, _mm256_mul_ps(_mm256_loadu_ps(b.vi + i), beta2));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2s), eps);
    p = _mm256_fmadd_ps(neg_step, _mm256_div_ps(m, denom), p);
    store_state8(b.p + i, p, b.stream_state);
    store_state8(b.m + i, m, b.stream_state);
    store_state8(b.v + i, v, b.stream_state);
    if (b.out) store_out8<O>(b.out, i, p, stream);
  }
  if (stream || b.stream_state) _mm_sfence();
  adam_scalar<G, O>(b, h, i, hi);
}
template <DT G>
FZ_AVX512 double sumsq_block_avx512(const void* g, int64_t lo, int64_t hi) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    __m512 x = load_grad16<G>(g, i);
    acc = _mm512_fmadd_ps(x, x, acc);
  }
  float tail = 0.f;
  for (; i < hi; ++i) {
    float x = load_grad<G>(g, i);
    tail = std::fma(x, x, tail);
  }
  return double(_mm512_reduce_add_ps(acc)) + double(tail);
}

template <DT G>
FZ_AVX2 double sumsq_block_avx2(const void* g, int64_t lo, int64_t hi) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 x = load_grad8<G>(g, i);
    acc = _mm256_fmadd_ps(x, x, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  double sum = 0.0;
  for (float x : lanes) sum += x;
  for (; i < hi; ++i) {
    float x = load_grad<G>(g, i);
    sum += double(x) * x;
  }
  return sum;
}
#endif  // FZ_X86

int64_t best_isa() {
#ifdef FZ_X86
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return kAVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kAVX2;
#endif
  return kScalar;
}

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
