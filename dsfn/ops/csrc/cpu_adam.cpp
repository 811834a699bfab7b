// dsfn host AdamW: one fused, vectorised, OpenMP-parallel pass over (param, grad, exp_avg,
// exp_avg_sq[, low-precision param copy]) for fp32 master weights on the CPU.
//
// A plain C ABI loaded with ctypes by dsfn/ops/cpu_adam.py (built there with
// torch.utils.cpp_extension.load(..., is_python_module=False)). It includes no torch
// header, so the build takes about a second, and ctypes releases the GIL during a call.
//
// Math: torch.optim.AdamW's order of float32 operations (see dsfn/ops/adamw.py):
//     p  = p * decay                                  decay = 1 - lr*wd
//     m  = fma(g - m, w1, m)          (w1 < 0.5)      torch.lerp's vector kernel
//        = fma(g - m, w1 - 1, g)      (otherwise)
//     v  = fma(w2 * g, g, v * beta2)                  mul_, addcmul_ (contracted by torch)
//     d  = sqrt(v) / bc2_sqrt + eps                   sqrt correctly rounded (vsqrtps)
//     p  = p + (neg_step * m) / d                     addcdiv_, neg_step = -lr / bc1
// No other contraction: compile with -ffp-contract=off (and -fno-math-errno so sqrt
// vectorises). The result depends only on the element, never on the thread count.
//
// Portability: no -march=native. The hot loops are compiled three times with GCC's
// target_clones (x86-64-v4 = AVX-512, x86-64-v3 = AVX2+FMA, baseline) and picked at load
// time, so one cached build runs correctly on any x86-64 machine sharing the cache.
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define DSFN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DSFN_CLONES
#endif

namespace {

constexpr int64_t kChunk = 1 << 16;   // elements per parallel work item (256 KiB of fp32)
constexpr int64_t kBlock = 1024;      // elements per inner block (stack buffers stay in L1)

enum DType : int32_t { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };

inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// IEEE half <-> float, bit exact (the algorithms of the FP16 library that c10::Half uses).
inline float half_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = UINT32_C(0xE0) << 23;
  const float normalized = f32_from_bits((two_w >> 4) + exp_offset) * 0x1.0p-112f;
  const uint32_t magic_mask = UINT32_C(126) << 23;
  const float denormalized = f32_from_bits((two_w >> 17) | magic_mask) - 0.5f;
  const uint32_t cutoff = UINT32_C(1) << 27;
  return f32_from_bits(sign | (two_w < cutoff ? f32_to_bits(denormalized) : f32_to_bits(normalized)));
}

inline uint16_t f32_to_half(float f) {   // round to nearest even, NaN -> 0x7E00 (with sign)
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
  base = f32_from_bits((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = f32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
  const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00) : nonsign));
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {   // round to nearest even, NaN -> 0x7FC0 (c10::BFloat16)
  const uint32_t u = f32_to_bits(f);
  const uint32_t r = (u + UINT32_C(0x7FFF) + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(r);
}

struct Coef {
  float decay, neg_step, bc2_sqrt, w1, w1m1, beta2, w2, eps;
  int32_t small;   // w1 < 0.5: torch.lerp's first formula
};

DSFN_CLONES void load_bf16(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

DSFN_CLONES void load_f16(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = half_to_f32(src[i]);
}

DSFN_CLONES void store_bf16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

DSFN_CLONES void store_f16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_half(src[i]);
}

DSFN_CLONES void adam_block(float* __restrict p, const float* __restrict g, float* __restrict m,
                            float* __restrict v, int64_t n, const Coef c) {
  const float decay = c.decay, neg_step = c.neg_step, bc2_sqrt = c.bc2_sqrt, w1 = c.w1;
  const float w1m1 = c.w1m1, beta2 = c.beta2, w2 = c.w2, eps = c.eps;
  if (c.small) {
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[i];
      const float pi = p[i] * decay;
      const float mi = std::fma(gi - m[i], w1, m[i]);
      const float vi = std::fma(w2 * gi, gi, v[i] * beta2);
      const float d = std::sqrt(vi) / bc2_sqrt + eps;
      m[i] = mi;
      v[i] = vi;
      p[i] = pi + (neg_step * mi) / d;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[i];
      const float pi = p[i] * decay;
      const float mi = std::fma(gi - m[i], w1m1, gi);
      const float vi = std::fma(w2 * gi, gi, v[i] * beta2);
      const float d = std::sqrt(vi) / bc2_sqrt + eps;
      m[i] = mi;
      v[i] = vi;
      p[i] = pi + (neg_step * mi) / d;
    }
  }
}

void run_range(float* p, const void* g, int32_t gtype, float* m, float* v, void* lowp, int32_t ltype,
               int64_t begin, int64_t end, const Coef& c) {
  alignas(64) float gbuf[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = (end - b < kBlock) ? end - b : kBlock;
    const float* gf;
    if (gtype == kF32) {
      gf = static_cast<const float*>(g) + b;
    } else {
      const uint16_t* gh = static_cast<const uint16_t*>(g) + b;
      if (gtype == kBF16) load_bf16(gh, gbuf, n); else load_f16(gh, gbuf, n);
      gf = gbuf;
    }
    adam_block(p + b, gf, m + b, v + b, n, c);
    if (ltype == kBF16) store_bf16(p + b, static_cast<uint16_t*>(lowp) + b, n);
    else if (ltype == kF16) store_f16(p + b, static_cast<uint16_t*>(lowp) + b, n);
  }
}

}  // namespace

extern "C" {

// Version of this ABI; dsfn/ops/cpu_adam.py refuses a library with another.
int32_t dsfn_cpu_adam_abi_version() { return 1; }

int32_t dsfn_cpu_adam_max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// One AdamW step over `ntensors` tensors, parallel over their concatenated chunks.
// Arrays are indexed by tensor; gtype/ltype: 0 float32, 1 bfloat16, 2 float16, -1 none
// (ltype only). Returns 0 (success) or -1 (bad argument).
int32_t dsfn_cpu_adamw(int64_t ntensors, float* const* params, const void* const* grads, const int32_t* gtypes,
                       float* const* exp_avgs, float* const* exp_avg_sqs, void* const* lowps,
                       const int32_t* ltypes, const int64_t* numels, float decay, float neg_step,
                       float bc2_sqrt, float w1, float beta2, float w2, float eps, int32_t nthreads) {
  if (ntensors < 0) return -1;
  const Coef c{decay, neg_step, bc2_sqrt, w1, w1 - 1.0f, beta2, w2, eps, w1 < 0.5f ? 1 : 0};
  // chunk_start[t]: index of tensor t's first chunk in the concatenated work
  int64_t total = 0;
  int64_t small_starts[64];
  int64_t* starts = ntensors + 1 <= 64 ? small_starts : new int64_t[ntensors + 1];
  for (int64_t t = 0; t < ntensors; ++t) {
    starts[t] = total;
    if (numels[t] < 0) { if (starts != small_starts) delete[] starts; return -1; }
    total += (numels[t] + kChunk - 1) / kChunk;
  }
  starts[ntensors] = total;
  if (nthreads < 1) nthreads = 1;
  if (nthreads > total) nthreads = static_cast<int32_t>(total > 0 ? total : 1);

#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
  for (int64_t k = 0; k < total; ++k) {
    // the tensor holding chunk k: last t with starts[t] <= k (binary search; empty tensors skipped)
    int64_t lo = 0, hi = ntensors - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (starts[mid] <= k) lo = mid; else hi = mid - 1;
    }
    const int64_t t = lo;
    const int64_t begin = (k - starts[t]) * kChunk;
    const int64_t end = begin + kChunk < numels[t] ? begin + kChunk : numels[t];
    run_range(params[t], grads[t], gtypes[t], exp_avgs[t], exp_avg_sqs[t], lowps[t], ltypes[t], begin, end, c);
  }
  if (starts != small_starts) delete[] starts;
  return 0;
}

}  // extern "C"
