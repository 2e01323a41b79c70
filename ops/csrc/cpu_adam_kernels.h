// The Adam kernels of ops/csrc/cpu_adam.cpp: the per-call constants, the scalar kernel (also every vector kernel's
// tail) and the AVX-512 / AVX2 kernels with per-function target attributes, chosen at run time by best_isa().
// Included by cpu_adam.cpp only (an anonymous namespace keeps it private to that translation unit).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

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

}  // namespace
