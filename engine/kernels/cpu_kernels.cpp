// CPU kernels for one Llama layer: residual-add + RMSNorm, SiLU-and-mul, RoPE, KV-cache store, and
// attention of decodes straight from the paged KV cache.
//
// Built at first use by stallfree/engine/kernels/cpu_fused.py (torch's JIT extension loader), which
// documents the semantics; each op matches the *_ref function of stallfree.engine.kernels.fused. Inputs
// are float32, bfloat16 or float16; every op computes in float32 and rounds once per stored value, except
// add_rmsnorm, which rounds where the model's RMSNorm does.
//
// Why: an eager decode iteration of a small model runs ~40 small torch ops per layer, each a few
// microseconds of dispatch on a 576-wide row, and the paged attention gathers whole pages before SDPA.
// These ops do a layer's elementwise work in four calls and read the cache pages in place.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

// The vector paths this build takes (-march=native: the CPU it is built on).
#if defined(__AVX2__) && defined(__FMA__)
#define SF_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SF_Q_VNNI512 1  // the int4 / int8 GEMM with vpdpbusd
#elif defined(SF_AVX2)
#define SF_Q_AVX2 1  // the same GEMM with vpmaddubsw + vpmaddwd
#endif

namespace {

// Rows handled per task: enough work that a task outweighs the thread pool's hand-off.
int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1));
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kHalf,
              name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 0 || t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// A 64-byte aligned scratch buffer.
struct AlignedBuffer {
  void* p = nullptr;
  explicit AlignedBuffer(int64_t bytes) {
    if (posix_memalign(&p, 64, std::max<int64_t>(bytes, 64))) p = nullptr;
    TORCH_CHECK(p != nullptr, "out of memory for a ", bytes, "-byte buffer");
  }
  ~AlignedBuffer() { free(p); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// A row of n values widened to float32; the bfloat16 case is a 16-bit shift, written so that the compiler
// vectorises it (c10::BFloat16's own conversion is not).
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

// ---- residual add + RMSNorm ---------------------------------------------------------------------------

template <typename scalar_t>
void add_rmsnorm_impl(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& w,
                      at::Tensor& out, at::Tensor& new_res, double eps) {
  const int64_t T = x.size(0), C = x.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* wp = w.data_ptr<scalar_t>();
  const scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
  scalar_t* op = out.data_ptr<scalar_t>();
  scalar_t* np = new_res.data_ptr<scalar_t>();
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0, os = out.stride(0),
                ns = new_res.stride(0);
  at::parallel_for(0, T, row_grain(C), [&](int64_t begin, int64_t end) {
    std::vector<float> r(C);
    for (int64_t t = begin; t < end; ++t) {
      float sum = 0.f;
      for (int64_t c = 0; c < C; ++c) {
        // NOTE: the norm reads the sum as stored (rounded to the activation dtype), as the torch path.
        const scalar_t s = rp ? static_cast<scalar_t>(to_f(xp[t * xs + c]) + to_f(rp[t * rs + c]))
                              : xp[t * xs + c];
        np[t * ns + c] = s;
        const float v = to_f(s);
        r[c] = v;
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(C) + static_cast<float>(eps));
      for (int64_t c = 0; c < C; ++c) {
        const float normed = to_f(static_cast<scalar_t>(r[c] * inv));
        op[t * os + c] = static_cast<scalar_t>(to_f(wp[c]) * normed);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                               const at::Tensor& weight, double eps) {
  check_float(x, "x");
  check_float(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "add_rmsnorm needs x (T, C) and weight (C,), got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "weight must be contiguous and share x's dtype");
  if (residual) {
    check_float(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x ", x.sizes(), " ", x.scalar_type());
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor new_res = at::empty(x.sizes(), x.options());  // a copy of x without a residual
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rmsnorm", [&] {
    add_rmsnorm_impl<scalar_t>(x, residual, weight, out, new_res, eps);
  });
  return {out, new_res};
}

// ---- SiLU and multiply ------------------------------------------------------------------------------

// g[i] = silu(g[i]) * u[i] for i < n; with AVX-512 through exp512 (~1 ulp, 16 at a time; libm's scalar
// expf was most of the op), elementwise either way.
inline void silu_mul_tile(float* g, const float* u, int64_t n);

template <typename scalar_t>
void silu_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, T, row_grain(I), [&](int64_t begin, int64_t end) {
    float gf[256], uf[256];
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* g = xp + t * xs;
      const scalar_t* u = g + I;
      for (int64_t i0 = 0; i0 < I; i0 += 256) {  // in tiles, widened first so that the math vectorises
        const int64_t n = std::min<int64_t>(256, I - i0);
        load_row(g + i0, gf, n);
        load_row(u + i0, uf, n);
        silu_mul_tile(gf, uf, n);
        for (int64_t i = 0; i < n; ++i) op[t * I + i0 + i] = static_cast<scalar_t>(gf[i]);
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul needs x (T, 2I), got ", x.sizes());
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_rows<scalar_t>(x, out); });
  return out;
}

// ---- rotary embedding -------------------------------------------------------------------------------

template <typename scalar_t>
void rope_rows(at::Tensor& x, const int64_t* pos, const float* cosp, const float* sinp, int64_t cs) {
  const int64_t T = x.size(0), n = x.size(1), half = x.size(2) / 2, s0 = x.stride(0), s1 = x.stride(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  at::parallel_for(0, T * n, row_grain(2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / n, h = item % n;
      scalar_t* row = xp + t * s0 + h * s1;
      const float* c = cosp + pos[t] * cs;
      const float* s = sinp + pos[t] * cs;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_f(row[i]), x2 = to_f(row[i + half]);
        row[i] = static_cast<scalar_t>(x1 * c[i] - x2 * s[i]);
        row[i + half] = static_cast<scalar_t>(x2 * c[i] + x1 * s[i]);
      }
    }
  });
}

void rope_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_cache,
           const at::Tensor& sin_cache) {
  check_float(q, "q");
  check_float(k, "k");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(2) % 2 == 0,
              "rope_ needs q (T, nh, hd) and k (T, nkv, hd) with an even hd, got ", q.sizes(), ", ",
              k.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() &&
                  cos_cache.sizes() == sin_cache.sizes() && cos_cache.dim() == 2 &&
                  cos_cache.size(1) == q.size(2) / 2,
              "cos/sin caches must be contiguous float32 (max_pos, hd/2)");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == q.size(0) && positions.is_contiguous(),
              "positions must be contiguous int64 (T,)");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " is outside the RoPE tables (",
                max_pos, ")");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope_", [&] {
    rope_rows<scalar_t>(q, pos, cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(), cos_cache.size(1));
    rope_rows<scalar_t>(k, pos, cos_cache.data_ptr<float>(), sin_cache.data_ptr<float>(), cos_cache.size(1));
  });
}

// ---- KV-cache store ---------------------------------------------------------------------------------

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  check_float(k, "k");
  check_float(v, "v");
  check_float(k_cache, "k_cache");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "store_kv needs k and v (T, nkv, hd) of one shape and dtype");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2) &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be contiguous (num_slots, nkv, hd) of one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == k.size(0) && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64 (T,)");
  TORCH_CHECK(k.stride(1) == k.size(2) && v.stride(1) == v.size(2), "k and v heads must be packed rows");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), slots = k_cache.size(0);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] < slots, "slot ", sp[t], " is outside the cache (", slots, " slots)");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_kv_in", [&] {
    using in_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "store_kv", [&] {
      const in_t* kp = k.data_ptr<in_t>();
      const in_t* vp = v.data_ptr<in_t>();
      scalar_t* kc = k_cache.data_ptr<scalar_t>();
      scalar_t* vc = v_cache.data_ptr<scalar_t>();
      for (int64_t t = 0; t < T; ++t) {
        if (sp[t] < 0) continue;  // a padding row
        for (int64_t i = 0; i < row; ++i) {
          kc[sp[t] * row + i] = static_cast<scalar_t>(to_f(kp[t * k.stride(0) + i]));
          vc[sp[t] * row + i] = static_cast<scalar_t>(to_f(vp[t * v.stride(0) + i]));
        }
      }
    });
  });
}

// ---- sums in a fixed order ----------------------------------------------------------------------------

// NOTE: same request, same answer. `#pragma omp simd reduction` lets the compiler regroup a sum as it
// vectorises, and how it does can depend on a buffer's alignment; these spell the grouping out (16 lanes,
// lane j adds elements j, j + 16, ... in order, then the lanes in a fixed tree), so a row's result is the
// same bits whichever call, batch or buffer it is computed in.
inline float ordered_dot(const float* a, const float* b, int64_t n) {
  float lane[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lane[j] += a[i + j] * b[i + j];
  for (int j = 0; i + j < n; ++j) lane[j] += a[i + j] * b[i + j];
  for (int w = 8; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

inline float ordered_sum(const float* a, int64_t n) {
  float lane[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lane[j] += a[i + j];
  for (int j = 0; i + j < n; ++j) lane[j] += a[i + j];
  for (int w = 8; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

#ifdef SF_AVX2
// A mask of the first n (0..8) of 8 lanes, for masked loads and stores.
inline __m256i first_n(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// f(i, load, store) for i = 0, 8, 16, ... < n: plain 8-lane loads and stores while 8 elements remain, masked
// ones for the last 1..7 only (a masked store is microcoded on AMD's cores, tens of cycles). Lanes past n
// load as 0 and are never stored; each lane's result is the same in either form.
template <typename F>
inline void each8(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    f(i, [](const float* p) { return _mm256_loadu_ps(p); }, [](float* p, __m256 v) { _mm256_storeu_ps(p, v); });
  if (i < n) {
    const __m256i k = first_n(n - i);
    f(i, [k](const float* p) { return _mm256_maskload_ps(p, k); },
      [k](float* p, __m256 v) { _mm256_maskstore_ps(p, k, v); });
  }
}
#endif

// s[i] = exp(s[i] - mx) for i < n. With AVX-512: 16 at a time (a masked tail), Cephes' expf polynomial
// after a Cody-Waite reduction (~1 ulp), each element's result a function of its value alone (so of no
// position, batch or buffer); 3-4x faster than libm's scalar expf, which was most of a chunk's attention.
// Cephes' expf: log2(e), ln 2 split in a high and a low part, and the polynomial (highest degree first).
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#ifdef __AVX512F__
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}
#elif defined(SF_AVX2)
// The same polynomial 8 at a time; 2^k built in the exponent bits (x is clamped so that k stays a normal
// float's exponent).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif

inline void silu_mul_tile(float* g, const float* u, int64_t n) {
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(k, g + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
    const __m512 y = _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_maskz_loadu_ps(k, u + i));
    _mm512_mask_storeu_ps(g + i, k, y);
  }
#elif defined(SF_AVX2)
  const __m256 one = _mm256_set1_ps(1.f);
  each8(n, [&](int64_t i, auto load, auto store) {
    const __m256 x = load(g + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
    store(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), load(u + i)));
  });
#else
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
#endif
}

inline void exp_shifted(float* s, int64_t n, float mx) {
#ifdef __AVX512F__
  const __m512 m = _mm512_set1_ps(mx);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(k, s + i);
    _mm512_mask_storeu_ps(s + i, k, exp512(_mm512_sub_ps(x, m)));
  }
#elif defined(SF_AVX2)
  const __m256 m = _mm256_set1_ps(mx);
  each8(n, [&](int64_t i, auto load, auto store) { store(s + i, exp256(_mm256_sub_ps(load(s + i), m))); });
#else
  for (int64_t i = 0; i < n; ++i) s[i] = std::exp(s[i] - mx);
#endif
}

// The largest of s[0 .. n-1] (n >= 1). Exact whatever the grouping, so vector lanes may take it in any order.
inline float max_of(const float* s, int64_t n) {
  int64_t i = 0;
  float mx = -std::numeric_limits<float>::infinity();
#ifdef SF_AVX2
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    mx = _mm_cvtss_f32(h);
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  return mx;
}

// ---- decode attention over the paged cache ----------------------------------------------------------

// One task = one decode x one KV head: the group's query heads share each key and value row as it is
// read. Scores are kept for the whole history (two passes: softmax, then the weighted sum of values).
// HD > 0 fixes the head dim at compile time (the common 64 and 128), so the per-row loops are unrolled and
// vectorised without remainders; HD = 0 reads it from q.
template <typename q_t, typename c_t, int64_t HD>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale) {
  const int64_t D = q.size(0), H = q.size(1), hd = HD > 0 ? HD : q.size(2);
  const int64_t KVH = k_cache.size(2), BS = k_cache.size(1), G = H / KVH, P = tables.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const q_t* qp = q.data_ptr<q_t>();
  const c_t* kc = k_cache.data_ptr<c_t>();
  const c_t* vc = v_cache.data_ptr<c_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  q_t* op = out.data_ptr<q_t>();
  const float sc = static_cast<float>(scale);
  // A task should hold ~64K multiply-adds; below that the thread pool's hand-off costs more than it saves.
  int64_t longest = 1;
  for (int64_t d = 0; d < D; ++d) longest = std::max<int64_t>(longest, lp[d]);
  const int64_t grain = std::max<int64_t>(1, 65536 / (2 * longest * G * hd));
  at::parallel_for(0, D * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), acc(G * hd), row(hd), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t d = item / KVH, h = item % KVH, len = lp[d];
      const int32_t* table = tp + d * P;
      for (int64_t g = 0; g < G; ++g) {
        float* qg = qf.data() + g * hd;
        load_row(qp + d * qs0 + (h * G + g) * qs1, qg, hd);
        for (int64_t i = 0; i < hd; ++i) qg[i] *= sc;
      }
      scores.assign(G * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const c_t* kr = kc + ((static_cast<int64_t>(table[t / BS]) * BS + t % BS) * KVH + h) * hd;
        load_row(kr, row.data(), hd);
        for (int64_t g = 0; g < G; ++g) scores[g * len + t] = ordered_dot(qf.data() + g * hd, row.data(), hd);
      }
      std::vector<float> denom(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        exp_shifted(sg, len, max_of(sg, len));
        denom[g] = ordered_sum(sg, len);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const c_t* vr = vc + ((static_cast<int64_t>(table[t / BS]) * BS + t % BS) * KVH + h) * hd;
        load_row(vr, row.data(), hd);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * hd;
#pragma omp simd
          for (int64_t i = 0; i < hd; ++i) ag[i] += p * row[i];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < hd; ++i)
          op[(d * H + h * G + g) * hd + i] = static_cast<q_t>(acc[g * hd + i] / denom[g]);
    }
  });
}

#ifdef SF_AVX2
// Lane t of the result is the sum of v[t]'s 8 lanes in the order j + 4, j + 2, j + 1 (float addition
// commutes exactly, so which operand a lane was does not matter).
inline __m256 reduce8(const __m256* v) {
  __m256 w[4], x[2];
  for (int m = 0; m < 4; ++m)
    w[m] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * m], v[2 * m + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * m], v[2 * m + 1], 0x31));
  for (int m = 0; m < 2; ++m)
    x[m] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // z's lane 4h + i holds v[2i + h]'s sum: put v[t]'s in lane t.
  return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

#endif

#ifdef __AVX512F__

// ---- attention of many rows over the paged cache (AVX-512, or AVX2 as two halves) ---------------------

// Lane t of the result is the sum of v[t]'s 16 lanes, every vector summed in the same tree (lanes j and
// j + 8, then j and j + 4, then j and j + 2, then j and j + 1; float addition commutes exactly, so which
// operand a vector was in a shuffle does not change its bits). 45 shuffles and adds for 16 sums, against
// 16 x 15 scalar adds one at a time.
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int m = 0; m < 8; ++m)
    w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 4; ++m)
    x[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int m = 0; m < 2; ++m)
    y[m] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // z's lane 4k + j holds v[4j + k]'s sum: put v[t]'s in lane t.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, z);
}

template <typename T>
inline __m512 load16(const T* p) {
  alignas(64) float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  return _mm512_load_ps(f);
}
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}


// The attention's 16-lane float vector: one AVX-512 register.
using vec16 = __m512;
inline vec16 v_zero() { return _mm512_setzero_ps(); }
inline vec16 v_set1(float x) { return _mm512_set1_ps(x); }
inline vec16 v_load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
inline void v_store(float* p, vec16 v) { _mm512_store_ps(p, v); }
inline vec16 v_mul(vec16 a, vec16 b) { return _mm512_mul_ps(a, b); }
inline vec16 v_fmadd(vec16 a, vec16 b, vec16 c) { return _mm512_fmadd_ps(a, b, c); }
inline vec16 v_reduce16(const vec16* v) { return reduce16(v); }

#elif defined(SF_AVX2)

// ---- attention of many rows over the paged cache (AVX2: a 16-lane vector as two halves) ---------------

struct vec16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline vec16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vec16 v_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vec16 v_load(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline void v_store(float* p, vec16 v) { _mm256_store_ps(p, v.lo), _mm256_store_ps(p + 8, v.hi); }
inline vec16 v_mul(vec16 a, vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vec16 v_fmadd(vec16 a, vec16 b, vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
// reduce16's tree: lanes j and j + 8 (the halves), then reduce8's j + 4, j + 2, j + 1.
inline vec16 v_reduce16(const vec16* v) {
  __m256 u[16];
  for (int t = 0; t < 16; ++t) u[t] = _mm256_add_ps(v[t].lo, v[t].hi);
  return {reduce8(u), reduce8(u + 8)};
}

template <typename T>
inline vec16 load16(const T* p) {
  alignas(32) float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  return v_load(f);
}
template <>
inline vec16 load16<float>(const float* p) {
  return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
template <>
inline vec16 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(b)), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(b, 1)), 16))};
}

#endif

#if defined(__AVX512F__) || defined(SF_AVX2)
#define SF_ROWS_ATTENTION 1

// Keys per tile: scores come 16 at a time (one vector), and values are widened 16 rows at a time.
constexpr int64_t kKeyTile = 16;

// One task = up to R consecutive rows that read the same pages (a prefill chunk's rows; a decode is a group
// of one) x one KV head: the group's R x G query vectors share each key and value row as it is widened,
// which a chunk of R rows would otherwise widen R times. HD (a multiple of 16) is fixed at compile time.
//
// NOTE: same request, same answer. What is computed for one row does not depend on the others in its group
// or batch: its score for key t is its query vector times key t in a fixed order (FMAs over the head dim in
// 16-lane pieces, then reduce16's tree), whichever rows share the tile; key tiles start at key 0 for every
// row; the softmax covers exactly its own keys (max, then exp, then ordered_sum); and its output adds p x
// value over its keys in ascending order, one FMA per element. A decode alone and the same row amid a chunk
// are the same sequence of operations.
template <typename q_t, typename c_t, int64_t HD>
void rows_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale) {
  static_assert(HD % 16 == 0, "head dim must be a multiple of 16");
  constexpr int64_t C = HD / 16;  // vectors per head row
  const int64_t D = q.size(0), H = q.size(1), KVH = k_cache.size(2), BS = k_cache.size(1), G = H / KVH;
  const int64_t P = tables.size(1), qs0 = q.stride(0), qs1 = q.stride(1);
  const q_t* qp = q.data_ptr<q_t>();
  const c_t* kc = k_cache.data_ptr<c_t>();
  const c_t* vc = v_cache.data_ptr<c_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  q_t* op = out.data_ptr<q_t>();
  const float sc = static_cast<float>(scale);
  // Groups: consecutive rows with the same table, at most R of them (R x G <= 32 query vectors).
  const int64_t R = std::max<int64_t>(1, std::min<int64_t>(16, 32 / G));
  std::vector<int64_t> starts;
  int64_t longest = 1;
  for (int64_t d = 0; d < D; ++d) {
    longest = std::max<int64_t>(longest, lp[d]);
    const bool joins = !starts.empty() && d - starts.back() < R &&
                       std::memcmp(tp + d * P, tp + starts.back() * P, P * sizeof(int32_t)) == 0;
    if (!joins) starts.push_back(d);
  }
  const int64_t NG = static_cast<int64_t>(starts.size());
  starts.push_back(D);
  const int64_t grain = std::max<int64_t>(1, 65536 / (2 * longest * R * G * HD));
  at::parallel_for(0, NG * KVH, grain, [&](int64_t begin, int64_t end) {
    const int64_t NVmax = R * G, Lpad = (longest + kKeyTile - 1) / kKeyTile * kKeyTile;
    AlignedBuffer qbuf(NVmax * HD * 4), sbuf(NVmax * Lpad * 4), kbuf(kKeyTile * HD * 4),
        abuf(NVmax * HD * 4);
    float* qf = static_cast<float*>(qbuf.p);
    float* scores = static_cast<float*>(sbuf.p);
    float* kv = static_cast<float*>(kbuf.p);
    float* acc = static_cast<float*>(abuf.p);
    std::vector<float> denom(NVmax);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t grp = item / KVH, h = item % KVH, d0 = starts[grp], nr = starts[grp + 1] - d0;
      const int64_t NV = nr * G;  // query vector r * G + g: row d0 + r, query head h * G + g
      const int32_t* table = tp + d0 * P;
      int64_t lmax = 0;
      for (int64_t r = 0; r < nr; ++r) lmax = std::max<int64_t>(lmax, lp[d0 + r]);
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t g = 0; g < G; ++g) {
          float* qv = qf + (r * G + g) * HD;
          load_row(qp + (d0 + r) * qs0 + (h * G + g) * qs1, qv, HD);
          for (int64_t i = 0; i < HD; ++i) qv[i] *= sc;
        }
      auto widen_tile = [&](const c_t* cache, int64_t t0) {  // rows t0 .. t0 + 15 of the cache, zeros past lmax
        for (int64_t j = 0; j < kKeyTile; ++j) {
          const int64_t t = t0 + j;
          if (t < lmax) {
            const c_t* src = cache + ((static_cast<int64_t>(table[t / BS]) * BS + t % BS) * KVH + h) * HD;
            for (int64_t c = 0; c < C; ++c) v_store(kv + j * HD + c * 16, load16(src + c * 16));
          } else {
            for (int64_t c = 0; c < C; ++c) v_store(kv + j * HD + c * 16, v_zero());
          }
        }
      };
      // Scores, 16 keys at a time.
      for (int64_t t0 = 0; t0 < lmax; t0 += kKeyTile) {
        widen_tile(kc, t0);
        for (int64_t v = 0; v < NV; ++v) {
          if (lp[d0 + v / G] <= t0) continue;
          vec16 qv[C], part[kKeyTile];
          for (int64_t c = 0; c < C; ++c) qv[c] = v_load(qf + v * HD + c * 16);
          for (int64_t j = 0; j < kKeyTile; ++j) {
            vec16 s = v_mul(qv[0], v_load(kv + j * HD));
            for (int64_t c = 1; c < C; ++c) s = v_fmadd(qv[c], v_load(kv + j * HD + c * 16), s);
            part[j] = s;
          }
          v_store(scores + v * Lpad + t0, v_reduce16(part));
        }
      }
      for (int64_t v = 0; v < NV; ++v) {
        const int64_t len = lp[d0 + v / G];
        float* sv = scores + v * Lpad;
        exp_shifted(sv, len, max_of(sv, len));
        denom[v] = ordered_sum(sv, len);
      }
      // Weighted values, 16 keys at a time, each row over its own keys in ascending order.
      std::memset(acc, 0, NV * HD * sizeof(float));
      for (int64_t t0 = 0; t0 < lmax; t0 += kKeyTile) {
        widen_tile(vc, t0);
        for (int64_t v = 0; v < NV; ++v) {
          const int64_t nk = std::min<int64_t>(kKeyTile, lp[d0 + v / G] - t0);
          if (nk <= 0) continue;
          const float* sv = scores + v * Lpad + t0;
          vec16 a[C];
          for (int64_t c = 0; c < C; ++c) a[c] = v_load(acc + v * HD + c * 16);
          for (int64_t j = 0; j < nk; ++j) {
            const vec16 p = v_set1(sv[j]);
            for (int64_t c = 0; c < C; ++c) a[c] = v_fmadd(p, v_load(kv + j * HD + c * 16), a[c]);
          }
          for (int64_t c = 0; c < C; ++c) v_store(acc + v * HD + c * 16, a[c]);
        }
      }
      for (int64_t v = 0; v < NV; ++v) {
        const int64_t r = v / G, g = v % G;
        q_t* dst = op + ((d0 + r) * H + h * G + g) * HD;
        for (int64_t i = 0; i < HD; ++i) dst[i] = static_cast<q_t>(acc[v * HD + i] / denom[v]);
      }
    }
  });
}

#endif

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  check_float(q, "q");
  check_float(k_cache, "k_cache");
  TORCH_CHECK(q.dim() == 3, "q must be (D, H, hd), got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be contiguous (num_blocks, block_size, nkv, hd) of one dtype");
  const int64_t D = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == hd && H % KVH == 0, "q heads ", H, " x ", hd, " do not fit the cache's ",
              KVH, " x ", k_cache.size(3));
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == D && block_tables.is_contiguous(),
              "block_tables must be contiguous int32 (D, pages)");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == D &&
                  seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32 (D,)");
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int64_t BS = k_cache.size(1), P = block_tables.size(1), NB = k_cache.size(0);
  for (int64_t d = 0; d < D; ++d) {
    TORCH_CHECK(lp[d] >= 1 && lp[d] <= P * BS, "decode ", d, ": history of ", lp[d],
                " tokens does not fit its ", P, " pages");
    for (int64_t p = 0; p < (lp[d] + BS - 1) / BS; ++p)
      TORCH_CHECK(tp[d * P + p] >= 0 && tp[d * P + p] < NB, "decode ", d, ": block ", tp[d * P + p],
                  " is outside the cache");
  }
  at::Tensor out = at::empty({D, H, hd}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_q", [&] {
    using q_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "decode_kv", [&] {
#ifdef SF_ROWS_ATTENTION
      if (hd == 64) {
        rows_attention_impl<q_t, scalar_t, 64>(q, k_cache, v_cache, block_tables, seq_lens, out, scale);
      } else if (hd == 128) {
        rows_attention_impl<q_t, scalar_t, 128>(q, k_cache, v_cache, block_tables, seq_lens, out, scale);
      } else {
#else
      if (hd == 64) {
        decode_impl<q_t, scalar_t, 64>(q, k_cache, v_cache, block_tables, seq_lens, out, scale);
      } else if (hd == 128) {
        decode_impl<q_t, scalar_t, 128>(q, k_cache, v_cache, block_tables, seq_lens, out, scale);
      } else {
#endif
        decode_impl<q_t, scalar_t, 0>(q, k_cache, v_cache, block_tables, seq_lens, out, scale);
      }
    });
  });
  return out;
}

// ---- linear layers: one GEMM for every row count ---------------------------------------------------

// y (T, N) = x (T, K) W^T with W held compactly: int4 in groups of 32 along K (Q4_1-style: w = code * scale
// + min per group, codes 0..15), int8 with one scale per output row (stored as code + 128 in 0..255, so w =
// code * scale - 128 * scale, the same form with one scale and min for the whole row), or bf16.
//
// NOTE: same request, same answer. Every output y[t, n] is one fixed sequence of operations whatever the
// batch: how many rows share the call only changes which rows are computed together, never how one row is,
// so a token's logits do not depend on its batch, its chunk or a prefix-cache hit (the kernels this replaced
// switched to another GEMM by row count, and the two rounded differently).
//
// int4 and int8 (the default CPU mode): integer dot products, as llama.cpp's Q4_1 x Q8_1. Each row of x is
// quantized per group of 32 (dx = max |x| / 127, xq = round(x / dx) in -127..127, the same for a row
// whatever else is in the batch); the products code x xq are summed exactly in int32 (AVX512-VNNI's
// vpdpbusd adds four u8 x s8 products per lane, AVX2's vpmaddubsw + vpmaddwd the same four in two steps; in
// any grouping, as integers); then, per group, float32:
// y += isum * (scale * dx), and at the end y += sum over groups of min * (dx * sum xq). The integer sums
// are exact, so only the float steps round, in one fixed order per output:
// - K is padded to Kp (a multiple of 64) with zero codes, zero scales and zero activations;
// - the groups come in blocks: Kp / 256 blocks of 8 groups, then blocks of 2 groups. In a block of 8, lane
//   j (of 16) holds group j / 2's codes 16 (j % 2) .. + 15 over 4 vpdpbusd steps (4 codes a step); in a
//   block of 2, lane j holds group j / 8's codes 4 (j % 8) .. + 3 in one step. The codes and the quantized
//   activations are stored in this lane order (pack_weights below), so a step is one 64-byte vector;
// - lane j's float accumulator adds, block after block, float(its int32 sum) x (its group's scale x dx),
//   one FMA per block; then, 16 groups at a time in ascending order, min[g] x (dx_g x sum xq_g), one FMA
//   per lane; then the 16 lanes are summed in reduce16's tree.
// gemm_q_scalar spells the same operations out one lane at a time (the path for CPUs without AVX2,
// and the reference the tests hold the vector path to, bit for bit).
//
// bf16 weights: widened to float32 and multiplied with the bf16 activations by vdpbf16ps (AVX512-BF16;
// float32 FMAs without it), 16 lanes each adding its share of k in ascending order, then the same tree.

enum WeightKind : int64_t { kQ4 = 0, kQ8 = 1, kBF16 = 2 };

// Where the GEMMs put y[t, n]: plus the bias, rounded once to the output's dtype.
struct Out {
  void* p;
  at::ScalarType type;
  const float* bias;  // (N,) or nullptr
  int64_t N;
  void put(int64_t t, int64_t n, float v) const {
    if (bias) v += bias[n];
    const int64_t i = t * N + n;
    if (type == at::kBFloat16) {
      static_cast<at::BFloat16*>(p)[i] = at::BFloat16(v);
    } else if (type == at::kHalf) {
      static_cast<at::Half*>(p)[i] = at::Half(v);
    } else {
      static_cast<float*>(p)[i] = v;
    }
  }
};

inline float lane_tree(const float* lane) {
  float l[16];
  for (int j = 0; j < 16; ++j) l[j] = lane[j];
  for (int w = 8; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) l[j] += l[j + w];
  return l[0];
}

// The lane order of a padded row of Kp codes: nb8 blocks of 8 groups (4 steps each), then nb2 of 2 groups
// (1 step each); a step is 64 bytes, 4 per lane.
struct QShape {
  int64_t K, Kp, groups, nb8, nb2, steps;
  explicit QShape(int64_t k)
      : K(k), Kp((k + 63) / 64 * 64), groups(Kp / 32), nb8(Kp / 256), nb2((Kp % 256) / 64), steps(Kp / 64) {}
  int64_t blocks() const { return nb8 + nb2; }
  // The block of a step, and the group (0..groups-1) whose codes lane j of that step holds.
  int64_t block_of(int64_t step) const { return step < 4 * nb8 ? step / 4 : nb8 + (step - 4 * nb8); }
  int64_t group_of(int64_t step, int64_t j) const {
    return step < 4 * nb8 ? (step / 4) * 8 + j / 2 : 8 * nb8 + 2 * (step - 4 * nb8) + j / 8;
  }
  // The k of byte e (0..3) of lane j in a step.
  int64_t k_of(int64_t step, int64_t j, int64_t e) const {
    if (step < 4 * nb8) return group_of(step, j) * 32 + 16 * (j % 2) + 4 * (step % 4) + e;
    return group_of(step, j) * 32 + 4 * (j % 8) + e;
  }
  // Bytes of one column's packed int4 codes: in a block of 8, steps 0 and 1 share 64 bytes (low and high
  // nibbles of byte b), as do steps 2 and 3; in a block of 2, the step's bytes b and b + 32 share byte b.
  int64_t q4_bytes() const { return Kp / 2; }
  // Where code b of step s lives in a column's packed int4 codes: its byte, and the shift of its nibble.
  int64_t q4_byte(int64_t s, int64_t b) const {
    return s < 4 * nb8 ? (s / 4) * 128 + ((s % 4) / 2) * 64 + b : nb8 * 128 + (s - 4 * nb8) * 32 + b % 32;
  }
  int q4_shift(int64_t s, int64_t b) const { return static_cast<int>(s < 4 * nb8 ? (s % 2) * 4 : (b / 32) * 4); }
};

// The codes (N, K) uint8 in lane order: int4 (bits 4, codes 0..15) -> (N, Kp / 2), int8 (bits 8) -> (N, Kp).
at::Tensor pack_weights(const at::Tensor& codes, int64_t bits) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "codes must be uint8 (N, K)");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const at::Tensor c = codes.contiguous();
  const int64_t N = c.size(0);
  const QShape q(c.size(1));
  const uint8_t* cp = c.data_ptr<uint8_t>();
  at::Tensor out = at::zeros({N, bits == 4 ? q.q4_bytes() : q.Kp}, c.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t ob = out.size(1);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t s = 0; s < q.steps; ++s) {
      for (int64_t b = 0; b < 64; ++b) {
        const int64_t k = q.k_of(s, b / 4, b % 4);
        const uint8_t v = k < q.K ? cp[n * q.K + k] : 0;
        if (bits == 8) {
          op[n * ob + s * 64 + b] = v;
        } else {
          TORCH_CHECK(v < 16, "int4 codes must be 0..15");
          op[n * ob + q.q4_byte(s, b)] |= static_cast<uint8_t>(v << q.q4_shift(s, b));
        }
      }
    }
  }
  return out;
}

// pack_weights undone: (N, K) uint8 codes.
at::Tensor unpack_weights(const at::Tensor& packed, int64_t bits, int64_t K) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte, "packed must be uint8 (N, bytes)");
  const QShape q(K);
  TORCH_CHECK(packed.size(1) == (bits == 4 ? q.q4_bytes() : q.Kp), "packed has ", packed.size(1),
              " bytes per row, not the lane order of K=", K);
  const at::Tensor p = packed.contiguous();
  const int64_t N = p.size(0), ib = p.size(1);
  const uint8_t* pp = p.data_ptr<uint8_t>();
  at::Tensor out = at::empty({N, K}, p.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t s = 0; s < q.steps; ++s)
      for (int64_t b = 0; b < 64; ++b) {
        const int64_t k = q.k_of(s, b / 4, b % 4);
        if (k >= K) continue;
        op[n * K + k] = bits == 8 ? pp[n * ib + s * 64 + b] : (pp[n * ib + q.q4_byte(s, b)] >> q.q4_shift(s, b)) & 15;
      }
  return out;
}

// Rows of x quantized per group of 32, in lane order: xq (T, Kp) int8; dxl (T, blocks, 16): each lane's
// group's dx; xs (T, G16): dx_g x sum of the group's xq, G16 = groups rounded up to 16, zeros after. The
// buffers are the calling thread's, reused from call to call (a call is tens of microseconds at one row,
// and three tensor allocations were a fifth of it).
struct QActs {
  const int8_t* xq;
  const float* dxl;
  const float* xs;
  int64_t g16;
};

struct QScratch {
  std::vector<int8_t> xq;
  std::vector<float> dxl, xs;
  int64_t lanes_k = -1;                   // the K the tables below are for
  std::vector<int32_t> src, lane_group;  // word i of a row holds codes src[i] ..; lane i's group
};

// One group of 32 values: xq = round-to-nearest-even(v x (127 / amax)) into dst, returns the sum of xq;
// *dx = amax / 127. Exact integer results and two float roundings, the same on either branch.
inline int32_t quantize_group(const float* v, int8_t* dst, float* dx) {
#ifdef __AVX512F__
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  // cvtps_epi32 rounds to nearest even (the default rounding mode, as std::nearbyint below)
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qb));
  *dx = amax / 127.f;
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#elif defined(SF_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  alignas(32) int32_t q[32];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    // cvtps_epi32 rounds to nearest even (the default rounding mode, as std::nearbyint below)
    const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], id));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * i), qi);
    sum = _mm256_add_epi32(sum, qi);
  }
  for (int e = 0; e < 32; ++e) dst[e] = static_cast<int8_t>(q[e]);
  alignas(32) int32_t s8[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(s8), sum);
  *dx = amax / 127.f;
  return s8[0] + s8[1] + s8[2] + s8[3] + s8[4] + s8[5] + s8[6] + s8[7];
#else
  float amax = 0.f;
  for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(v[e]));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int e = 0; e < 32; ++e) {
    const int32_t c = static_cast<int32_t>(std::nearbyint(v[e] * id));
    dst[e] = static_cast<int8_t>(c);
    sum += c;
  }
  *dx = amax / 127.f;
  return sum;
#endif
}

QActs quantize_rows(const at::Tensor& x, const QShape& q) {
  const int64_t T = x.size(0), G16 = (q.groups + 15) / 16 * 16, NB = q.blocks();
  thread_local QScratch buf;
  buf.xq.resize(T * q.Kp);
  buf.dxl.resize(T * NB * 16);
  buf.xs.resize(T * G16);
  if (buf.lanes_k != q.K) {
    buf.src.resize(q.Kp / 4);
    buf.lane_group.resize(NB * 16);
    for (int64_t s = 0; s < q.steps; ++s)
      for (int64_t j = 0; j < 16; ++j) {
        buf.src[s * 16 + j] = static_cast<int32_t>(q.k_of(s, j, 0));
        buf.lane_group[q.block_of(s) * 16 + j] = static_cast<int32_t>(q.group_of(s, j));
      }
    buf.lanes_k = q.K;
  }
  int8_t* xq = buf.xq.data();
  float* dxl = buf.dxl.data();
  float* xs = buf.xs.data();
  const int32_t* src = buf.src.data();
  const int32_t* lane_group = buf.lane_group.data();
  QActs a{xq, dxl, xs, G16};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(q.Kp), [&](int64_t begin, int64_t end) {
      std::vector<float> v(q.Kp, 0.f), dx(q.groups);
      std::vector<int8_t> row(q.Kp);
      for (int64_t t = begin; t < end; ++t) {
        load_row(xp + t * q.K, v.data(), q.K);  // the padding after K stays 0
        for (int64_t g = 0; g < q.groups; ++g)
          xs[t * G16 + g] =
              static_cast<float>(quantize_group(v.data() + g * 32, row.data() + g * 32, &dx[g]));
        for (int64_t g = 0; g < q.groups; ++g) xs[t * G16 + g] *= dx[g];
        for (int64_t g = q.groups; g < G16; ++g) xs[t * G16 + g] = 0.f;
        int32_t* words = reinterpret_cast<int32_t*>(xq + t * q.Kp);
        for (int64_t i = 0; i < q.Kp / 4; ++i) std::memcpy(&words[i], row.data() + src[i], 4);
        for (int64_t i = 0; i < NB * 16; ++i) dxl[t * NB * 16 + i] = dx[lane_group[i]];
      }
    });
  });
  return a;
}

// The int4 / int8 weights as the kernels read them. scale and min: (N, groups) with group stride gs = 1
// (int4), or one per column with gs = 0 (int8).
struct QWeights {
  QShape q;
  int64_t bits, col_bytes, gs;
  const uint8_t* codes;
  const float* scale;
  const float* minv;
  float scale_of(int64_t n, int64_t g) const { return gs ? scale[n * q.groups + g] : scale[n]; }
  float min_of(int64_t n, int64_t g) const { return gs ? minv[n * q.groups + g] : minv[n]; }
  // The code of byte b of step s of column n.
  int32_t code(int64_t n, int64_t s, int64_t b) const {
    const uint8_t* c = codes + n * col_bytes;
    return bits == 8 ? c[s * 64 + b] : (c[q.q4_byte(s, b)] >> q.q4_shift(s, b)) & 15;
  }
};

// One lane at a time: the operations the vector path does, in its order.
void gemm_q_scalar(const QActs& a, const QWeights& w, int64_t T, int64_t N, const Out& op) {
  const QShape& q = w.q;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t t = 0; t < T; ++t) {
        const int8_t* xq = a.xq + t * q.Kp;
        float acc[16] = {0.f};
        for (int64_t s = 0; s < q.steps;) {
          const int64_t blk = q.block_of(s), ns = s < 4 * q.nb8 ? 4 : 1;
          for (int j = 0; j < 16; ++j) {
            int32_t isum = 0;
            for (int64_t u = s; u < s + ns; ++u)
              for (int e = 0; e < 4; ++e) isum += w.code(n, u, 4 * j + e) * xq[u * 64 + 4 * j + e];
            const float f = w.scale_of(n, q.group_of(s, j)) * a.dxl[(t * q.blocks() + blk) * 16 + j];
            acc[j] = std::fma(static_cast<float>(isum), f, acc[j]);
          }
          s += ns;
        }
        for (int64_t g0 = 0; g0 < a.g16; g0 += 16)
          for (int j = 0; j < 16; ++j) {
            const float m = g0 + j < q.groups || !w.gs ? w.min_of(n, g0 + j) : 0.f;  // int8: one min
            acc[j] = std::fma(m, a.xs[t * a.g16 + g0 + j], acc[j]);
          }
        op.put(t, n, lane_tree(acc));
      }
  });
}

#ifdef SF_Q_VNNI512

// Step s's 64 codes of column n (codes 0..255) as one vector; two steps of a block of 8 at once.
inline void codes_pair(const QWeights& w, int64_t n, int64_t blk, int64_t half, __m512i& a, __m512i& b) {
  const uint8_t* c = w.codes + n * w.col_bytes;
  if (w.bits == 8) {
    a = _mm512_loadu_si512(c + (blk * 4 + half * 2) * 64);
    b = _mm512_loadu_si512(c + (blk * 4 + half * 2 + 1) * 64);
    return;
  }
  const __m512i p = _mm512_loadu_si512(c + blk * 128 + half * 64);
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  a = _mm512_and_si512(p, lo4);
  b = _mm512_and_si512(_mm512_srli_epi16(p, 4), lo4);
}

inline __m512i codes_single(const QWeights& w, int64_t n, int64_t b2) {
  const uint8_t* c = w.codes + n * w.col_bytes;
  if (w.bits == 8) return _mm512_loadu_si512(c + (4 * w.q.nb8 + b2) * 64);
  const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + w.q.nb8 * 128 + b2 * 32));
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(p, lo4)),
                            _mm256_and_si256(_mm256_srli_epi16(p, 4), lo4), 1);
}

// Each lane's group scale in a block: 8 groups two lanes each, or 2 groups eight lanes each.
inline __m512 scale_lanes(const QWeights& w, int64_t n, int64_t blk) {
  if (!w.gs) return _mm512_set1_ps(w.scale[n]);
  if (blk < w.q.nb8) {
    const __m512 s = _mm512_castps256_ps512(_mm256_loadu_ps(w.scale + n * w.q.groups + blk * 8));
    return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), s);
  }
  const __m512 s = _mm512_maskz_loadu_ps(0x3, w.scale + n * w.q.groups + 8 * w.q.nb8 + 2 * (blk - w.q.nb8));
  return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), s);
}

// R rows x C columns (R x C <= 16 outputs): every output is gemm_q_scalar's sequence of operations, 16
// lanes at a time, whatever the tile's shape. A column at a time (its R accumulators in registers: with all
// R x C live the compiler spilled them), its codes read in order, then one reduce16 for the tile.
template <int R, int C>
void q_tile(const QActs& a, const QWeights& w, int64_t t0, int64_t n0, const Out& op) {
  const QShape& q = w.q;
  const int8_t* x0 = a.xq + t0 * q.Kp;
  const float* d0 = a.dxl + t0 * q.blocks() * 16;
  __m512 v[16];
  for (int c = 0; c < C; ++c) {
    const int64_t n = n0 + c;
    __m512 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < q.nb8; ++blk) {
      __m512i v0, v1, v2, v3;
      codes_pair(w, n, blk, 0, v0, v1);
      codes_pair(w, n, blk, 1, v2, v3);
      const __m512 sl = scale_lanes(w, n, blk);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int8_t* x = x0 + r * q.Kp + blk * 256;
        const __m512i z = _mm512_setzero_si512();
        // two chains of exact integer sums (their grouping cannot change the result): half the latency of one
        __m512i s = _mm512_dpbusd_epi32(z, v0, _mm512_loadu_si512(x));
        __m512i u = _mm512_dpbusd_epi32(z, v2, _mm512_loadu_si512(x + 128));
        s = _mm512_dpbusd_epi32(s, v1, _mm512_loadu_si512(x + 64));
        u = _mm512_dpbusd_epi32(u, v3, _mm512_loadu_si512(x + 192));
        s = _mm512_add_epi32(s, u);
        const __m512 f = _mm512_mul_ps(sl, _mm512_loadu_ps(d0 + (r * q.blocks() + blk) * 16));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), f, acc[r]);
      }
    }
    for (int64_t b2 = 0; b2 < q.nb2; ++b2) {
      const int64_t blk = q.nb8 + b2;
      const __m512i cv = codes_single(w, n, b2);
      const __m512 sl = scale_lanes(w, n, blk);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int8_t* x = x0 + r * q.Kp + (4 * q.nb8 + b2) * 64;
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), cv, _mm512_loadu_si512(x));
        const __m512 f = _mm512_mul_ps(sl, _mm512_loadu_ps(d0 + (r * q.blocks() + blk) * 16));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), f, acc[r]);
      }
    }
    for (int64_t g0 = 0; g0 < a.g16; g0 += 16) {
      const __mmask16 live = g0 + 16 <= q.groups ? 0xFFFF : (g0 < q.groups ? (1u << (q.groups - g0)) - 1 : 0);
      const __m512 m = w.gs ? _mm512_maskz_loadu_ps(live, w.minv + n * q.groups + g0) : _mm512_set1_ps(w.minv[n]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_loadu_ps(a.xs + (t0 + r) * a.g16 + g0), acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) v[r * C + c] = acc[r];
  }
  for (int i = R * C; i < 16; ++i) v[i] = _mm512_setzero_ps();
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(v));
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) op.put(t0 + r, n0 + c, sums[r * C + c]);
}

// Tasks of 16 columns; in a task, tiles of 4 rows pass over the 16 columns' codes (in L1) in turn.
void gemm_q(const QActs& a, const QWeights& w, int64_t T, int64_t N, const Out& op) {
  constexpr int64_t CB = 16;
  at::parallel_for(0, (N + CB - 1) / CB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task * CB, n1 = std::min(N, n0 + CB);
      for (int64_t t = 0; t < T; t += 4) {
        const int64_t rt = std::min<int64_t>(4, T - t);
        // One reduce16 per 16 outputs: 1 x 16 and 2 x 8 tiles for the last rows where the columns allow.
        int64_t n = n0;
        if (rt == 1)
          for (; n + 16 <= n1; n += 16) q_tile<1, 16>(a, w, t, n, op);
        if (rt == 2)
          for (; n + 8 <= n1; n += 8) q_tile<2, 8>(a, w, t, n, op);
        for (; n < n1; n += 4) {
          if (rt == 4) q_tile<4, 4>(a, w, t, n, op);
          if (rt == 3) q_tile<3, 4>(a, w, t, n, op);
          if (rt == 2) q_tile<2, 4>(a, w, t, n, op);
          if (rt == 1) q_tile<1, 4>(a, w, t, n, op);
        }
      }
    }
  });
}

#endif

#ifdef SF_Q_AVX2

// ---- the same GEMM with AVX2 (CPUs without AVX512-VNNI: AMD Zen 2/3, Intel parts without AVX-512) -------

// A step's 16 lanes are two 256-bit halves (lanes 0-7, 8-15). Integer sums: vpmaddubsw adds two u8 x s8
// products into an int16 and vpmaddwd pairs those into the int32 of the lane's 4 bytes, as vpdpbusd does in
// one instruction. Both are exact where the int16 cannot overflow: int4 codes (0..15) x |xq| <= 127 give
// pairs of at most 3,810, so the 4 steps of a block are summed in int16 (<= 15,240) before vpmaddwd; an int8
// code (0..255) is split into its nibbles, code = 16 hi + lo, each nibble's sum exact as for int4. The
// float steps are gemm_q_scalar's, lane for lane, and the 16 lanes are summed in lane_tree's order (j + 8
// first: the two halves; then j + 4, j + 2, j + 1 in reduce8), so this path's bits are the reference's.

// int16 pairs of 32 codes (0..15) x 32 activations: code[2i] x[2i] + code[2i+1] x[2i+1], exact (<= 3,810).
inline __m256i pairs16(__m256i codes, const int8_t* x) {
  return _mm256_maddubs_epi16(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// The int32 lane sums (4 bytes each) of int16 pairs, times k.
inline __m256i widen16(__m256i p, int16_t k = 1) { return _mm256_madd_epi16(p, _mm256_set1_epi16(k)); }

inline __m256i low4(__m256i p) { return _mm256_and_si256(p, _mm256_set1_epi8(0x0F)); }
inline __m256i high4(__m256i p) { return _mm256_and_si256(_mm256_srli_epi16(p, 4), _mm256_set1_epi8(0x0F)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Half h (lanes 8h .. 8h + 7) of a block's codes for column n, as nibbles 0..15: a block of 8 groups has 4
// steps (int4: 4 vectors; int8: each step's low then high nibbles, 8), a block of 2 groups one step (int4:
// 1; int8: 2). The int8 nibbles' products are summed apart: the high ones are worth 16.
template <int BITS>
struct HalfCodes {
  __m256i v[BITS == 4 ? 4 : 8];

  void block8(const QWeights& w, int64_t n, int64_t blk, int h) {
    const uint8_t* c = w.codes + n * w.col_bytes;
    if (BITS == 8) {
      for (int u = 0; u < 4; ++u) {
        const __m256i p = load32(c + blk * 256 + u * 64 + 32 * h);
        v[2 * u] = low4(p);
        v[2 * u + 1] = high4(p);
      }
    } else {
      const __m256i p0 = load32(c + blk * 128 + 32 * h), p1 = load32(c + blk * 128 + 64 + 32 * h);
      v[0] = low4(p0), v[1] = high4(p0), v[2] = low4(p1), v[3] = high4(p1);
    }
  }

  void block2(const QWeights& w, int64_t n, int64_t b2, int h) {
    const uint8_t* c = w.codes + n * w.col_bytes;
    if (BITS == 8) {
      const __m256i p = load32(c + (4 * w.q.nb8 + b2) * 64 + 32 * h);
      v[0] = low4(p), v[1] = high4(p);
    } else {
      const __m256i p = load32(c + w.q.nb8 * 128 + b2 * 32);
      v[0] = h == 0 ? low4(p) : high4(p);
    }
  }

  // The int32 lane sums for the row whose block starts at x (its steps 64 bytes apart): exact, as the
  // int16 sums of a block's pairs stay within 4 x 3,810.
  template <int STEPS>
  __m256i dot(const int8_t* x, int h) const {
    if (BITS == 4) {
      __m256i s = pairs16(v[0], x + 32 * h);
      for (int u = 1; u < STEPS; ++u) s = _mm256_add_epi16(s, pairs16(v[u], x + u * 64 + 32 * h));
      return widen16(s);
    }
    __m256i lo = pairs16(v[0], x + 32 * h), hi = pairs16(v[1], x + 32 * h);
    for (int u = 1; u < STEPS; ++u) {
      lo = _mm256_add_epi16(lo, pairs16(v[2 * u], x + u * 64 + 32 * h));
      hi = _mm256_add_epi16(hi, pairs16(v[2 * u + 1], x + u * 64 + 32 * h));
    }
    return _mm256_add_epi32(widen16(hi, 16), widen16(lo));
  }
};

// Half h's lane scales in a block: 8 groups two lanes each, or 2 groups eight lanes each.
inline __m256 scale_half(const QWeights& w, int64_t n, int64_t blk, int h) {
  if (!w.gs) return _mm256_set1_ps(w.scale[n]);
  if (blk < w.q.nb8) {
    const __m128 s = _mm_loadu_ps(w.scale + n * w.q.groups + blk * 8 + 4 * h);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  }
  return _mm256_set1_ps(w.scale[n * w.q.groups + 8 * w.q.nb8 + 2 * (blk - w.q.nb8) + h]);
}

// Half h of the mins of groups g0 .. g0 + 15 (zero past the last group; int8: the column's one min).
inline __m256 min_half(const QWeights& w, int64_t n, int64_t g0, int h) {
  if (!w.gs) return _mm256_set1_ps(w.minv[n]);
  const int64_t g = g0 + 8 * h, live = std::max<int64_t>(0, std::min<int64_t>(8, w.q.groups - g));
  if (live == 8) return _mm256_loadu_ps(w.minv + n * w.q.groups + g);
  return _mm256_maskload_ps(w.minv + n * w.q.groups + g, first_n(live));  // reads only the live lanes
}

// Half H of column n's R accumulators (lanes 8H .. 8H + 7): gemm_q_scalar's operations for those lanes.
template <int BITS, int R, int H>
inline void q_half(const QActs& a, const QWeights& w, int64_t t0, int64_t n, __m256 (&acc)[R]) {
  const QShape& q = w.q;
  const int8_t* x0 = a.xq + t0 * q.Kp;
  const float* d0 = a.dxl + t0 * q.blocks() * 16 + 8 * H;
  HalfCodes<BITS> codes;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < q.nb8; ++blk) {
    codes.block8(w, n, blk, H);
    const __m256 sl = scale_half(w, n, blk, H);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i s = codes.template dot<4>(x0 + r * q.Kp + blk * 256, H);
      const __m256 f = _mm256_mul_ps(sl, _mm256_loadu_ps(d0 + (r * q.blocks() + blk) * 16));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), f, acc[r]);
    }
  }
  for (int64_t b2 = 0; b2 < q.nb2; ++b2) {
    const int64_t blk = q.nb8 + b2;
    codes.block2(w, n, b2, H);
    const __m256 sl = scale_half(w, n, blk, H);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i s = codes.template dot<1>(x0 + r * q.Kp + (4 * q.nb8 + b2) * 64, H);
      const __m256 f = _mm256_mul_ps(sl, _mm256_loadu_ps(d0 + (r * q.blocks() + blk) * 16));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), f, acc[r]);
    }
  }
  for (int64_t g0 = 0; g0 < a.g16; g0 += 16) {
    const __m256 m = min_half(w, n, g0, H);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(a.xs + (t0 + r) * a.g16 + g0 + 8 * H), acc[r]);
  }
}

// R rows x C columns (R x C <= 8 outputs), a column at a time (each half's R accumulators in registers),
// then lanes j and j + 8 added and one reduce8 for the tile.
template <int BITS, int R, int C>
void q_tile2(const QActs& a, const QWeights& w, int64_t t0, int64_t n0, const Out& op) {
  __m256 v[8];
  for (int c = 0; c < C; ++c) {
    __m256 lo[R], hi[R];
    q_half<BITS, R, 0>(a, w, t0, n0 + c, lo);
    q_half<BITS, R, 1>(a, w, t0, n0 + c, hi);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) v[r * C + c] = _mm256_add_ps(lo[r], hi[r]);
  }
  for (int i = R * C; i < 8; ++i) v[i] = _mm256_setzero_ps();
  alignas(32) float sums[8];
  _mm256_store_ps(sums, reduce8(v));
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) op.put(t0 + r, n0 + c, sums[r * C + c]);
}

// Tasks of 16 columns; in a task, tiles of up to 4 rows pass over the 16 columns' codes (in L1) in turn.
template <int BITS>
void gemm_q2(const QActs& a, const QWeights& w, int64_t T, int64_t N, const Out& op) {
  constexpr int64_t CB = 16;
  at::parallel_for(0, (N + CB - 1) / CB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task * CB, n1 = std::min(N, n0 + CB);
      for (int64_t t = 0; t < T; t += 4) {
        const int64_t rt = std::min<int64_t>(4, T - t);
        int64_t n = n0;
        if (rt == 1)
          for (; n + 8 <= n1; n += 8) q_tile2<BITS, 1, 8>(a, w, t, n, op);
        for (; n < n1; n += 4) {  // N is a multiple of 4
          if (rt == 4) q_tile2<BITS, 4, 2>(a, w, t, n, op), q_tile2<BITS, 4, 2>(a, w, t, n + 2, op);
          if (rt == 3) q_tile2<BITS, 3, 2>(a, w, t, n, op), q_tile2<BITS, 3, 2>(a, w, t, n + 2, op);
          if (rt == 2) q_tile2<BITS, 2, 4>(a, w, t, n, op);
          if (rt == 1) q_tile2<BITS, 1, 4>(a, w, t, n, op);
        }
      }
    }
  });
}

void gemm_q(const QActs& a, const QWeights& w, int64_t T, int64_t N, const Out& op) {
  if (w.bits == 4) {
    gemm_q2<4>(a, w, T, N, op);
  } else {
    gemm_q2<8>(a, w, T, N, op);
  }
}

#endif

// ---- bf16 weights ----

struct Weights {
  int64_t K;
  const uint16_t* bf16;  // (N, K)
};

// Rows up to which the weights are widened in registers per row tile instead of into a shared panel.
constexpr int64_t kDirectRows = 8;

#if defined(__AVX512F__) && defined(__AVX512BF16__)

// The activations as bf16 rows; a step covers 32 k.
using act_t = uint16_t;
constexpr int64_t kStep = 32;
using wvec_t = __m512bh;

inline __m512bh widen_step(const Weights& w, int64_t n, int64_t k) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(w.bf16 + n * w.K + k));
}
inline void store_step(act_t* dst, __m512bh v) { _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(v)); }
inline __m512bh load_w(const act_t* src) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(src)); }
inline __m512 mac(__m512 acc, const act_t* x, __m512bh wv) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_loadu_si512(x)), wv);
}

#elif defined(__AVX512F__)

using act_t = float;
constexpr int64_t kStep = 16;
using wvec_t = __m512;

// Weights k .. k + 15 (k a multiple of 16) of column n as float32.
inline __m512 widen_step(const Weights& w, int64_t n, int64_t k) {
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.bf16 + n * w.K + k));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(c), 16));
}

inline void store_step(act_t* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline __m512 load_w(const act_t* src) { return _mm512_loadu_ps(src); }
inline __m512 mac(__m512 acc, const act_t* x, __m512 wv) { return _mm512_fmadd_ps(_mm512_loadu_ps(x), wv, acc); }

#endif

#ifdef __AVX512F__

// Column n's K weights, widened as widen_step does, into dst.
void widen_column(const Weights& w, int64_t n, act_t* dst) {
  for (int64_t k = 0; k < w.K; k += kStep) store_step(dst + k, widen_step(w, n, k));
}

// R rows x 4 columns. Direct: the weights read in registers from the weight matrix; else from a panel
// (4 columns at stride K). The same operations either way.
template <int R, bool kDirect>
void tile(const act_t* x, const Weights& w, int64_t t0, int64_t n0, const act_t* wp, const Out& op) {
  const int64_t K = w.K;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kStep) {
    wvec_t wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = kDirect ? widen_step(w, n0 + c, k) : load_w(wp + c * K + k);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = mac(acc[r][c], x + r * K + k, wv[c]);
  }
  // The R x 4 sums at once: reduce16's tree is lane_tree's (lanes j + 8, j + 4, j + 2, j + 1), so each
  // output has the same bits as summed alone, for a fifth of the work.
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = i < 4 * R ? acc[i / 4][i % 4] : _mm512_setzero_ps();
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(v));
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) op.put(t0 + r, n0 + c, sums[r * 4 + c]);
}

// Rows t .. T-1 of 4 columns, 4 rows at a time then the rest.
template <bool kDirect>
void rows(const act_t* xp, const Weights& w, int64_t t0, int64_t T, int64_t n0, const act_t* wp, const Out& op) {
  const int64_t K = w.K;
  int64_t t = t0;
  for (; t + 4 <= T; t += 4) tile<4, kDirect>(xp + t * K, w, t, n0, wp, op);
  const int64_t left = T - t;
  if (left == 3) tile<3, kDirect>(xp + t * K, w, t, n0, wp, op);
  if (left == 2) tile<2, kDirect>(xp + t * K, w, t, n0, wp, op);
  if (left == 1) tile<1, kDirect>(xp + t * K, w, t, n0, wp, op);
}

void gemm_bf16(const act_t* xp, const Weights& w, int64_t T, int64_t N, const Out& op) {
  const int64_t K = w.K;
  if (T <= kDirectRows) {
    at::parallel_for(0, N / 4, std::max<int64_t>(1, 8192 / K), [&](int64_t begin, int64_t end) {
      for (int64_t cb = begin; cb < end; ++cb) rows<true>(xp, w, 0, T, cb * 4, nullptr, op);
    });
    return;
  }
  // Columns per task: a panel of CB x K widened weights (<= 256 KiB) stays in L2 for all the rows.
  const int64_t CB = std::max<int64_t>(4, std::min<int64_t>(64, (262144 / (K * sizeof(act_t))) / 4 * 4));
  at::parallel_for(0, (N + CB - 1) / CB, 1, [&](int64_t begin, int64_t end) {
    AlignedBuffer panel(CB * K * sizeof(act_t));
    act_t* pp = static_cast<act_t*>(panel.p);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task * CB, nc = std::min<int64_t>(CB, N - n0);
      for (int64_t c = 0; c < nc; ++c) widen_column(w, n0 + c, pp + c * K);
      // A tile of 4 rows (in L1) passes over the whole panel (in L2) before the next rows come in.
      for (int64_t t = 0; t < T; t += 4) {
        const int64_t t1 = std::min<int64_t>(t + 4, T);
        for (int64_t c = 0; c < nc; c += 4) rows<false>(xp, w, t, t1, n0 + c, pp + c * K, op);
      }
    }
  });
}

#else

// Without AVX-512: float32 FMAs lane by lane, in the order of the float32 AVX-512 path.
void gemm_bf16_scalar(const float* xp, const Weights& w, int64_t T, int64_t N, const Out& op) {
  const int64_t K = w.K;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> col(K);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t bits = static_cast<uint32_t>(w.bf16[n * K + k]) << 16;
        std::memcpy(&col[k], &bits, 4);
      }
      for (int64_t t = 0; t < T; ++t) {
        float lane[16] = {0.f};
        for (int64_t k = 0; k < K; k += 16)
          for (int j = 0; j < 16; ++j) lane[j] = std::fma(xp[t * K + k + j], col[k + j], lane[j]);
        op.put(t, n, lane_tree(lane));
      }
    }
  });
}

#endif

// The int4 / int8 weights of a packed_linear call, checked.
QWeights q_weights(int64_t kind, int64_t K, int64_t N, const at::Tensor& weight, const at::Tensor& scale,
                   const at::Tensor& minv) {
  QWeights w{QShape(K), kind == kQ4 ? 4 : 8, 0, kind == kQ4 ? 1 : 0, nullptr, nullptr, nullptr};
  w.col_bytes = kind == kQ4 ? w.q.q4_bytes() : w.q.Kp;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.size(1) == w.col_bytes,
              kind == kQ4 ? "int4" : "int8", " weight must be uint8 (N, ", w.col_bytes,
              ") in pack_weights' lane order, got ", weight.sizes());
  const int64_t per = kind == kQ4 ? N * w.q.groups : N;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && minv.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  minv.is_contiguous() && scale.numel() == per && minv.numel() == per,
              "scale and min must be contiguous float32 with ", per, " values (",
              kind == kQ4 ? "(N, padded K / 32)" : "(N,)", ")");
  w.codes = weight.data_ptr<uint8_t>();
  w.scale = scale.data_ptr<float>();
  w.minv = minv.data_ptr<float>();
  return w;
}

at::Tensor linear_impl(const at::Tensor& x, int64_t kind, const at::Tensor& weight, const at::Tensor& scale,
                       const at::Tensor& minv, const c10::optional<at::Tensor>& bias, int64_t out_features,
                       bool scalar) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2, "packed_linear needs x (T, K), got ", x.sizes());
  const int64_t T = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % 32 == 0 && N % 4 == 0, "packed_linear needs K % 32 == 0 and N % 4 == 0, got K=", K,
              " N=", N);
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2 && weight.size(0) == N, "weight must be contiguous with ",
              N, " rows");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be (N,)");
  }
  at::Tensor out = at::empty({T, N}, x.options());
  at::Tensor b32;
  if (bias) b32 = bias->to(at::kFloat).contiguous();
  const Out op{out.data_ptr(), x.scalar_type(), bias ? b32.data_ptr<float>() : nullptr, N};
  if (kind == kQ4 || kind == kQ8) {
    const QWeights w = q_weights(kind, K, N, weight, scale, minv);
    const QActs a = quantize_rows(x.contiguous(), w.q);
#if defined(SF_Q_VNNI512) || defined(SF_Q_AVX2)
    if (!scalar) {
      gemm_q(a, w, T, N, op);
    } else
#endif
    {
      gemm_q_scalar(a, w, T, N, op);
    }
  } else {
    TORCH_CHECK(kind == kBF16, "unknown weight kind ", kind);
    TORCH_CHECK(!scalar, "the scalar reference covers the int4 and int8 kinds");
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.size(1) == K, "bf16 weight must be (N, K)");
    const Weights w{K, reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>())};
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const at::Tensor xa = x.to(at::kBFloat16).contiguous();  // (T, K) bf16
    gemm_bf16(reinterpret_cast<const act_t*>(xa.data_ptr<at::BFloat16>()), w, T, N, op);
#elif defined(__AVX512F__)
    const at::Tensor xa = x.to(at::kFloat).contiguous();  // (T, K) float32
    gemm_bf16(xa.data_ptr<float>(), w, T, N, op);
#else
    const at::Tensor xa = x.to(at::kFloat).contiguous();
    gemm_bf16_scalar(xa.data_ptr<float>(), w, T, N, op);
#endif
  }
  return out;
}

at::Tensor packed_linear(const at::Tensor& x, int64_t kind, const at::Tensor& weight, const at::Tensor& scale,
                         const at::Tensor& minv, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return linear_impl(x, kind, weight, scale, minv, bias, out_features, false);
}

// gemm_q_scalar whatever the CPU: the reference tests hold packed_linear's int4 / int8 path to, bit for bit.
at::Tensor packed_linear_scalar(const at::Tensor& x, int64_t kind, const at::Tensor& weight,
                                const at::Tensor& scale, const at::Tensor& minv,
                                const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return linear_impl(x, kind, weight, scale, minv, bias, out_features, true);
}

// ---- the decoder stack in one call ---------------------------------------------------------------

// Every layer of a Llama-style decoder over one batch, the same kernel calls in the same order as the
// Python fused path (LlamaDecoderLayer.forward_fused with the cpu backend's paged-rows attention), so the
// bits are the same; what goes is the Python between them (~11 op calls and their glue per layer, a third
// of a batch-1 decode step on a 2-core box). Per layer l: norms[2l] / norms[2l + 1] (input and
// post-attention RMSNorm weights, in x's dtype), linears 4l .. 4l + 3 (qkv, o, gate_up, down as
// packed_linear's weight, scale, minv, bias, kind, out_features); norms[2L] the final norm.
// Returns the final norm's output (T, C).
at::Tensor decoder_stack(const at::Tensor& x0, const at::Tensor& positions, const at::Tensor& cos_cache,
                         const at::Tensor& sin_cache, at::TensorList norms, double eps, at::TensorList weights,
                         at::TensorList scales, at::TensorList mins,
                         const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef kinds,
                         at::IntArrayRef outs, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         int64_t num_heads, int64_t num_kv_heads, double scale) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(v_caches.size()) == L, "need one K and one V cache per layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L + 1, "need 2 norms per layer and a final one, got ",
              norms.size(), " for ", L, " layers");
  const auto n = static_cast<size_t>(4 * L);
  TORCH_CHECK(weights.size() == n && scales.size() == n && mins.size() == n && biases.size() == n &&
                  kinds.size() == n && outs.size() == n,
              "need 4 linear layers (qkv, o, gate_up, down) per layer");
  TORCH_CHECK(x0.dim() == 2, "x must be (T, C), got ", x0.sizes());
  const int64_t T = x0.size(0), hd = k_caches[0].size(3);
  const int64_t q_size = num_heads * hd, kv_size = num_kv_heads * hd;
  auto linear = [&](const at::Tensor& h, int64_t i) {
    return packed_linear(h, kinds[i], weights[i], scales[i], mins[i], biases.get(i), outs[i]);
  };
  at::Tensor x = x0;
  c10::optional<at::Tensor> residual;
  for (int64_t l = 0; l < L; ++l) {
    auto [h, res] = add_rmsnorm(x, residual, norms[2 * l], eps);
    const at::Tensor qkv = linear(h, 4 * l);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "layer ", l, ": qkv has ", qkv.size(1), " columns, not ",
                q_size + 2 * kv_size);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, hd});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, hd});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, hd});
    rope_(q, k, positions, cos_cache, sin_cache);
    const at::Tensor& kc = k_caches[l];
    const at::Tensor& vc = v_caches[l];
    store_kv(k, v, kc.view({-1, kc.size(2), kc.size(3)}), vc.view({-1, vc.size(2), vc.size(3)}), slot_mapping);
    // NOTE: after the store: a chunk's rows see the chunk's earlier keys in the cache
    const at::Tensor out = paged_decode_attention(q, kc, vc, block_tables, seq_lens, scale);
    std::tie(h, residual) = add_rmsnorm(linear(out.reshape({T, q_size}), 4 * l + 1), res, norms[2 * l + 1], eps);
    x = linear(silu_and_mul(linear(h, 4 * l + 2)), 4 * l + 3);
  }
  return std::get<0>(add_rmsnorm(x, residual, norms[2 * L], eps));
}

// Which instructions this build's kernels use, for the engine's log and the benchmarks' records.
std::string kernel_isa() {
#if defined(SF_Q_VNNI512)
  std::string isa = "int4/int8: avx512-vnni";
#elif defined(SF_Q_AVX2)
  std::string isa = "int4/int8: avx2";
#else
  std::string isa = "int4/int8: scalar";
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  isa += ", bf16: avx512-bf16";
#elif defined(__AVX512F__)
  isa += ", bf16: avx512";
#else
  isa += ", bf16: scalar";
#endif
#if defined(__AVX512F__)
  isa += ", attention: avx512";
#elif defined(SF_ROWS_ATTENTION)
  isa += ", attention: avx2";
#else
  isa += ", attention: scalar";
#endif
  return isa;
}

}  // namespace

TORCH_LIBRARY(stallfree_cpu, m) {
  m.def("add_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_cache, Tensor sin_cache) -> ()");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale) -> Tensor");
  m.def(
      "packed_linear(Tensor x, int kind, Tensor weight, Tensor scale, Tensor minv, Tensor? bias, "
      "int out_features) -> Tensor");
  m.def(
      "packed_linear_scalar(Tensor x, int kind, Tensor weight, Tensor scale, Tensor minv, Tensor? bias, "
      "int out_features) -> Tensor");
  m.def("pack_weights(Tensor codes, int bits) -> Tensor");
  m.def("unpack_weights(Tensor packed, int bits, int K) -> Tensor");
  m.def("kernel_isa() -> str");
  m.def(
      "decoder_stack(Tensor x, Tensor positions, Tensor cos_cache, Tensor sin_cache, Tensor[] norms, float eps, "
      "Tensor[] weights, Tensor[] scales, Tensor[] mins, Tensor?[] biases, int[] kinds, int[] outs, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "int num_heads, int num_kv_heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree_cpu, CPU, m) {
  m.impl("add_rmsnorm", &add_rmsnorm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_", &rope_);
  m.impl("store_kv", &store_kv);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_linear_scalar", &packed_linear_scalar);
  m.impl("pack_weights", &pack_weights);
  m.impl("unpack_weights", &unpack_weights);
  m.impl("decoder_stack", &decoder_stack);
}

TORCH_LIBRARY_IMPL(stallfree_cpu, CompositeExplicitAutograd, m) { m.impl("kernel_isa", &kernel_isa); }
