// Fused CPU kernels of the kernel contract (chatgate_kernels/__init__.py), built at first use
// by chatgate_kernels/cpu_native.py. Compiled with -ffp-contract=off: no multiply-add is fused,
// so the rotary rounds exactly where transformers' op-by-op torch code rounds.
//
// - paged_attention: every row of a varlen batch (decode and extend) reads its keys and values
//   through the block table in place, with float32 scores and accumulators; no gathered copy.
//   With AVX-512 or AVX2 and head_dim 64 or 128, a sequence's query tokens (up to 16 per work
//   item) load each key once for all their heads, and each row computes exactly as a one-token
//   decode step over its keys: a verify step's or an extend's rows have the bits of decode
//   steps'.
// - rotary_and_cache: rotates query heads in place and writes rotated keys and values into their
//   cache slots, in one pass.
// - add_rms_norm / silu_and_mul: the decoder's elementwise steps in one pass each, for the
//   quantized path (they round differently from transformers' torch code).
// - int4_linear / int8_linear: products with Q4_1-style weights (4-bit codes in groups of 32,
//   each group with a scale and a minimum), activations quantized to int8 per group of 32
//   (Q8_1) and multiplied in integer dot products, as llama.cpp multiplies a Q4_1 tensor;
//   int8_linear likewise with int8 weights and one scale per output row (blocked by 16 weight
//   rows with AVX512-VNNI, by 8 with AVX2: one pass over a block serves up to 8 or 4 activation
//   rows). The dot products run as AVX512-VNNI (dpbusd) or AVX2 (maddubs + madd; int4 with
//   weight rows interleaved by 8, see int4_pack), a plain loop elsewhere. Both prefetch the
//   rows ahead: cold weights are the time of a decode step.
// - DecoderStack: the quantized path's decoder layers, all of them in one call per step, made of
//   the kernels above with the dtypes and order of the op-by-op layers of
//   engine/quantized_cpu_model.py (so the same bits), without a Python round trip per op:
//   hundreds of small ops per step otherwise cost more than the products of a one-row decode
//   step.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using BF16 = c10::BFloat16;

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

template <typename Fn>
void dispatch_float(const at::Tensor& t, const char* name, Fn&& fn) {
  if (t.scalar_type() == at::kFloat) {
    fn(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    fn(BF16{});
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 only, got ", t.scalar_type());
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// e^x for 8 floats: Cephes' expf polynomial (within 2 ulp of std::exp on [-87, 88]; the input
// clamped to that range); ~1 ns an element where std::exp takes ~10.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln 2, in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const BF16* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline void store8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
inline void store8(BF16* y, __m256 v) {  // round to nearest even, as c10::BFloat16 (finite v)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_castsi256_si128(packed));
}
#endif

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// The elementwise kernels (rotary, add + RMSNorm, SiLU·mul) split their tokens over threads
// in chunks of this many: a decode step's few microseconds of them run on the calling thread,
// without a fork and join (which waits for a thread another process holds, on a shared CPU).
constexpr int64_t kInlineTokens = 64;
// Attention of fewer (query row, key) pairs than this (a one-row decode step's) runs on the
// calling thread, for the same reason; 16 times as many where multi_heads serves items of
// several query tokens (a verify step's), which load each key and value once for all rows.
constexpr int64_t kParallelPairs = 4096;

// One unit of attention work: query tokens [begin, end) of one sequence against one KV head.
struct Item {
  int64_t seq, kv_head, begin, end;
};

constexpr int64_t kChunk = 16;  // query tokens per work item (extend rows)
constexpr int64_t kKeysAhead = 8;  // keys (and values) prefetched ahead through the table

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define CHATGATE_FAST_ATTENTION 1
#endif

#if defined(__AVX512F__)
// exp8's polynomial over 16 floats.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i two_n = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(two_n));
}

// The fast attention path's vector (see score_rows): 16 floats of AVX-512.
struct Lanes {
  using F = __m512;
  static constexpr int W = 16;
  static constexpr int kAccumulators = 16;  // value accumulators a pass keeps (of 32 registers)
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* x) { return _mm512_loadu_ps(x); }
  static F load(const BF16* x) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static void store(float* y, F v) { _mm512_storeu_ps(y, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F exp(F x) { return exp16(x); }
  // lane i + lane i + 8, then + 4, + 2, + 1
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static float top(F v) { return _mm512_reduce_max_ps(v); }
  static __mmask16 first(int64_t n) {
    return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  }
  // x's first n lanes (n > 0), ``fill`` in the others
  static F load_first(const float* x, int64_t n, float fill) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first(n), x);
  }
  static void store_first(float* y, int64_t n, F v) { _mm512_mask_storeu_ps(y, first(n), v); }
  static F keep_first(F v, int64_t n) { return _mm512_maskz_mov_ps(first(n), v); }
  // The lane sums of 16 vectors: lane j of the result is the sum of s[j]'s lanes, added in
  // sum()'s order, so each sum has its bits, for 15 adds and 31 shuffles in all where
  // _mm512_reduce_add_ps spends about as many on one.
  static F sum_lanes(const F* s) {
    F t8[8], t4[4], t2[2];
    for (int j = 0; j < 8; ++j) {  // [lo(s_j), lo(s_j+8)] + [hi(s_j), hi(s_j+8)]
      t8[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[j], s[j + 8], 0x44),
                            _mm512_shuffle_f32x4(s[j], s[j + 8], 0xEE));
    }
    for (int j = 0; j < 4; ++j) {  // 128-bit chunks: s_j, s_j+4, s_j+8, s_j+12 (4 partials each)
      t4[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t8[j], t8[j + 4], 0x88),
                            _mm512_shuffle_f32x4(t8[j], t8[j + 4], 0xDD));
    }
    for (int j = 0; j < 2; ++j) {  // within chunks: 2 partials of two vectors each
      t2[j] = _mm512_add_ps(_mm512_shuffle_ps(t4[j], t4[j + 2], 0x44),
                            _mm512_shuffle_ps(t4[j], t4[j + 2], 0xEE));
    }
    const F sums = _mm512_add_ps(_mm512_shuffle_ps(t2[0], t2[1], 0x88),
                                 _mm512_shuffle_ps(t2[0], t2[1], 0xDD));
    // lane l holds vector order[l], and order is its own inverse
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), sums);
  }
};
#elif defined(CHATGATE_FAST_ATTENTION)
// The fast attention path's vector (see score_rows): 8 floats of AVX2.
struct Lanes {
  using F = __m256;
  static constexpr int W = 8;
  static constexpr int kAccumulators = 8;  // value accumulators a pass keeps (of 16 registers)
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* x) { return load8(x); }
  static F load(const BF16* x) { return load8(x); }
  static void store(float* y, F v) { _mm256_storeu_ps(y, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F exp(F x) { return exp8(x); }
  // lane i + lane i + 4, then + 2, + 1
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float top(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static __m256i first(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // x's first n lanes (n > 0), ``fill`` in the others
  static F load_first(const float* x, int64_t n, float fill) {
    const __m256i m = first(n);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(x, m),
                            _mm256_castsi256_ps(m));
  }
  static void store_first(float* y, int64_t n, F v) { _mm256_maskstore_ps(y, first(n), v); }
  static F keep_first(F v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(first(n))); }
  // The lane sums of 8 vectors: lane j of the result is the sum of s[j]'s lanes, added in
  // sum()'s order, so each sum has its bits.
  static F sum_lanes(const F* s) {
    F t4[4], t2[2];
    for (int j = 0; j < 4; ++j) {  // [lo(s_j), lo(s_j+4)] + [hi(s_j), hi(s_j+4)]
      t4[j] = _mm256_add_ps(_mm256_permute2f128_ps(s[j], s[j + 4], 0x20),
                            _mm256_permute2f128_ps(s[j], s[j + 4], 0x31));
    }
    for (int j = 0; j < 2; ++j) {  // within chunks: 2 partials of two vectors each
      t2[j] = _mm256_add_ps(_mm256_shuffle_ps(t4[j], t4[j + 2], 0x44),
                            _mm256_shuffle_ps(t4[j], t4[j + 2], 0xEE));
    }
    const F sums = _mm256_add_ps(_mm256_shuffle_ps(t2[0], t2[1], 0x88),
                                 _mm256_shuffle_ps(t2[0], t2[1], 0xDD));
    return _mm256_permute_ps(sums, 0xD8);  // chunks hold vectors 0, 2, 1, 3 (and 4, 6, 5, 7)
  }
};
#endif

#if defined(CHATGATE_FAST_ATTENTION)
using F = Lanes::F;
constexpr int64_t W = Lanes::W;

// Query rows against one KV head's keys, for a head_dim of W * V (W: the vector's floats): row
// r is query token r / group, which sees keys [0, first + r / group + 1), the last row
// ``longest`` of them (with ``kOneToken``, rows == group: every row sees them all). The keys
// are visited block by block through ``table`` (no division per key, the next block's keys and
// values prefetched). One token: each key is loaded once for its rows, each score one lane sum.
// Several tokens (whose rows outnumber the keys' conversions): W keys at a time converted to
// float once, then each row's W dot products summed together (Lanes::sum_lanes: the same bits);
// a row also scores the keys of its W past the last it sees (written, and never read by its
// softmax). ``q``: ``rows`` rows of W * V floats; ``cache_row``: the elements between two
// slots' rows; ``head``: this KV head's offset in a slot's row. Writes the float32 scores, row r
// at ``scores + r * longest``.
template <typename C, int V, bool kOneToken>
inline void score_rows(const float* q, int64_t rows, int64_t group, const C* kc, const C* vc,
                       const int32_t* table, int64_t block_size, int64_t cache_row, int64_t head,
                       int64_t first, int64_t longest, float scale, float* scores) {
  constexpr int64_t dim = W * V, lines = dim * sizeof(C) / 64;
  alignas(64) float keys[kOneToken ? 1 : W * dim];
  for (int64_t b = 0, p = 0; p < longest; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * block_size;
    const int64_t end = std::min(longest, p + block_size);
    if (end < longest) {
      const int64_t next = static_cast<int64_t>(table[b + 1]) * block_size;
      for (int64_t j = 0; j < std::min(block_size, longest - end); ++j) {
        for (int64_t l = 0; l < lines; ++l) {
          __builtin_prefetch(kc + (next + j) * cache_row + head + l * 64 / sizeof(C));
          __builtin_prefetch(vc + (next + j) * cache_row + head + l * 64 / sizeof(C));
        }
      }
    }
    if constexpr (kOneToken) {
      for (int64_t slot = base; p < end; ++p, ++slot) {
        const C* k = kc + slot * cache_row + head;
        F kv[V];
        for (int c = 0; c < V; ++c) kv[c] = Lanes::load(k + W * c);
        for (int64_t r = 0; r < rows; ++r) {
          const float* x = q + r * dim;
          F s = Lanes::mul(Lanes::load(x), kv[0]);
          for (int c = 1; c < V; ++c) s = Lanes::fmadd(Lanes::load(x + W * c), kv[c], s);
          scores[r * longest + p] = Lanes::sum(s) * scale;
        }
      }
      continue;
    }
    for (int64_t n; p < end; p += n) {
      n = std::min<int64_t>(W, end - p);
      const C* k0 = kc + (base + p % block_size) * cache_row + head;
      for (int64_t j = 0; j < W; ++j) {  // past n: zeros, so every row scores W keys
        for (int c = 0; c < V; ++c) {
          Lanes::store(keys + j * dim + W * c,
                       j < n ? Lanes::load(k0 + j * cache_row + W * c) : Lanes::zero());
        }
      }
      // the rows that see key p (the others see none of these)
      for (int64_t r = std::max<int64_t>(0, p - first) * group; r < rows; ++r) {
        const float* x = q + r * dim;
        F s[W];
        for (int j = 0; j < W; ++j) {
          const float* k = keys + j * dim;
          s[j] = Lanes::mul(Lanes::load(x), Lanes::load(k));
          for (int c = 1; c < V; ++c) {
            s[j] = Lanes::fmadd(Lanes::load(x + W * c), Lanes::load(k + W * c), s[j]);
          }
        }
        Lanes::store_first(scores + r * longest + p, n,
                           Lanes::mul(Lanes::sum_lanes(s), Lanes::set1(scale)));
      }
    }
  }
}

// A score row's first n entries to e^(s - max), in place; returns 1 / their sum.
inline float softmax_row(float* row, int64_t n) {
  F top = Lanes::set1(-INFINITY);
  for (int64_t p = 0; p < n; p += W) {
    top = Lanes::max(top, Lanes::load_first(row + p, n - p, -INFINITY));
  }
  const F peak = Lanes::set1(Lanes::top(top));
  F sum = Lanes::zero();
  for (int64_t p = 0; p < n; p += W) {
    const F e = Lanes::exp(Lanes::sub(Lanes::load_first(row + p, n - p, 0.0f), peak));
    Lanes::store_first(row + p, n - p, e);
    sum = Lanes::add(sum, Lanes::keep_first(e, n - p));
  }
  return 1.0f / Lanes::sum(sum);
}

// One decode token's heads against one KV head's cache, for a head_dim of W * V: the ``n``
// keys' scores (score_rows), then each head's softmax and values in registers. Writes ``out``
// (heads rows of W * V floats).
template <typename C, int V>
void decode_heads(const float* q, int64_t heads, const C* kc, const C* vc, const int32_t* table,
                  int64_t block_size, int64_t cache_row, int64_t head, int64_t n, float scale,
                  float* scores, float* out) {
  constexpr int64_t dim = W * V;
  score_rows<C, V, true>(q, heads, heads, kc, vc, table, block_size, cache_row, head, n - 1, n,
                         scale, scores);
  for (int64_t r = 0; r < heads; ++r) {
    float* row = scores + r * n;
    const F inv = Lanes::set1(softmax_row(row, n));
    F acc[V];
    for (int c = 0; c < V; ++c) acc[c] = Lanes::zero();
    for (int64_t b = 0, p = 0; p < n; ++b) {
      const int64_t end = std::min(n, p + block_size);
      for (int64_t slot = static_cast<int64_t>(table[b]) * block_size; p < end; ++p, ++slot) {
        const C* v = vc + slot * cache_row + head;
        const F w = Lanes::set1(row[p]);
        for (int c = 0; c < V; ++c) acc[c] = Lanes::fmadd(w, Lanes::load(v + W * c), acc[c]);
      }
    }
    for (int c = 0; c < V; ++c) Lanes::store(out + r * dim + W * c, Lanes::mul(acc[c], inv));
  }
}

// Several query tokens' heads against one KV head's cache (a verify step's or an extend's rows:
// row r is token r / group, which sees keys [0, first + r / group + 1)), each row with exactly
// decode_heads' arithmetic, so each token's output has the bits of a one-token decode step over
// its keys. The keys are loaded once for all rows (score_rows), the values once per tile of
// ``kTile`` rows, whose accumulators stay in registers. Writes ``out`` (rows rows).
template <typename C, int V>
void multi_heads(const float* q, int64_t rows, int64_t group, const C* kc, const C* vc,
                 const int32_t* table, int64_t block_size, int64_t cache_row, int64_t head,
                 int64_t first, float scale, float* scores, float* out) {
  constexpr int64_t dim = W * V, kTile = std::max(1, Lanes::kAccumulators / V);
  const int64_t longest = first + (rows - 1) / group + 1;
  auto count = [&](int64_t r) { return first + r / group + 1; };  // keys row r sees
  score_rows<C, V, false>(q, rows, group, kc, vc, table, block_size, cache_row, head, first,
                          longest, scale, scores);
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t tile = std::min(kTile, rows - r0);
    float inv[kTile];
    for (int64_t t = 0; t < tile; ++t) {
      inv[t] = softmax_row(scores + (r0 + t) * longest, count(r0 + t));
    }
    F acc[kTile][V];
    for (int t = 0; t < kTile; ++t)
      for (int c = 0; c < V; ++c) acc[t][c] = Lanes::zero();
    const int64_t n_all = count(r0), n_max = count(r0 + tile - 1);  // rows ascend in keys
    for (int64_t b = 0, p = 0; p < n_max; ++b) {
      const int64_t end = std::min(n_max, p + block_size);
      for (int64_t slot = static_cast<int64_t>(table[b]) * block_size; p < end; ++p, ++slot) {
        const C* v = vc + slot * cache_row + head;
        F vv[V];
        for (int c = 0; c < V; ++c) vv[c] = Lanes::load(v + W * c);
        if (tile == kTile && p < n_all) {  // a full tile whose rows all see p
          for (int t = 0; t < kTile; ++t) {
            const F w = Lanes::set1(scores[(r0 + t) * longest + p]);
            for (int c = 0; c < V; ++c) acc[t][c] = Lanes::fmadd(w, vv[c], acc[t][c]);
          }
        } else {
          for (int t = 0; t < tile; ++t) {
            if (p >= count(r0 + t)) continue;
            const F w = Lanes::set1(scores[(r0 + t) * longest + p]);
            for (int c = 0; c < V; ++c) acc[t][c] = Lanes::fmadd(w, vv[c], acc[t][c]);
          }
        }
      }
    }
    for (int t = 0; t < tile; ++t) {
      const F scale_t = Lanes::set1(inv[t]);
      for (int c = 0; c < V; ++c)
        Lanes::store(out + (r0 + t) * dim + W * c, Lanes::mul(acc[t][c], scale_t));
    }
  }
}

// One KV head's item: decode_heads for one query token, multi_heads for several.
template <typename C, int V>
inline void query_heads(const float* q, int64_t rows, int64_t group, const C* kc, const C* vc,
                        const int32_t* table, int64_t block_size, int64_t cache_row, int64_t head,
                        int64_t first, float scale, float* scores, float* out) {
  if (rows == group) {
    decode_heads<C, V>(q, rows, kc, vc, table, block_size, cache_row, head, first + 1, scale,
                       scores, out);
  } else {
    multi_heads<C, V>(q, rows, group, kc, vc, table, block_size, cache_row, head, first, scale,
                      scores, out);
  }
}
#endif

// Whether attention_fast runs for this head_dim: with AVX-512 or AVX2, 64 or 128.
inline bool fast_head_dim(int64_t dim) {
#if defined(CHATGATE_FAST_ATTENTION)
  return dim == 64 || dim == 128;
#else
  (void)dim;
  return false;
#endif
}

// query_heads where it runs (fast_head_dim): true if it wrote ``out``. ``first``: the keys before
// the item's first query token.
template <typename C>
inline bool attention_fast(const float* q, int64_t rows, int64_t group, const C* kc, const C* vc,
                           const int32_t* table, int64_t block_size, int64_t cache_row,
                           int64_t head, int64_t first, int64_t dim, float scale, float* scores,
                           float* out) {
#if defined(CHATGATE_FAST_ATTENTION)
  if (dim == 64) {
    query_heads<C, 64 / W>(q, rows, group, kc, vc, table, block_size, cache_row, head, first,
                           scale, scores, out);
    return true;
  }
  if (dim == 128) {
    query_heads<C, 128 / W>(q, rows, group, kc, vc, table, block_size, cache_row, head, first,
                            scale, scores, out);
    return true;
  }
#endif
  return false;
}

template <typename Q, typename C, typename O>
void attention_kernel(const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                      double scale_, at::Tensor& out) {
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t table_row = block_tables.stride(0);
  const Q* q = query.data_ptr<Q>();
  const C* kc = key_cache.data_ptr<C>();
  const C* vc = value_cache.data_ptr<C>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  O* o = out.data_ptr<O>();
  const float scale = static_cast<float>(scale_);

  std::vector<Item> items;
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t b = 0; b < q_len; b += kChunk) {
        items.push_back({s, g, b, std::min(b + kChunk, q_len)});
      }
    }
  }
  int64_t work = 0;  // (query row, key) pairs
  bool several = false;  // an item of more than one query token
  for (const Item& it : items) {
    work += (it.end - it.begin) * group * (lens[it.seq] - (starts[it.seq + 1] - starts[it.seq]) + it.end);
    several = several || it.end - it.begin > 1;
  }
  // multi_heads loads each key and value once for all of an item's rows: a verify step's few
  // query tokens cost little more than a decode step's one, and stay on the calling thread too.
  const int64_t inline_pairs =
      several && fast_head_dim(dim) ? 16 * kParallelPairs : kParallelPairs;
  const int64_t count = static_cast<int64_t>(items.size());
  at::parallel_for(0, count, work < inline_pairs ? count + 1 : 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf, scores, acc;
    for (int64_t i = lo; i < hi; ++i) {
      const Item& it = items[i];
      const int64_t first = lens[it.seq] - (starts[it.seq + 1] - starts[it.seq]);
      const int64_t rows = (it.end - it.begin) * group;  // (query token, head) pairs
      const int64_t longest = first + it.end;              // keys the last token sees
      const int32_t* table = tables + it.seq * table_row;
      qf.resize(rows * dim);
      scores.resize(rows * longest);
      acc.assign(rows * dim, 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = starts[it.seq] + it.begin + r / group;
        const Q* src = q + token * q_row + (it.kv_head * group + r % group) * q_head;
        for (int64_t d = 0; d < dim; ++d) qf[r * dim + d] = to_float(src[d]);
      }
      if (!attention_fast(qf.data(), rows, group, kc, vc, table, block_size, kv_heads * dim,
                          it.kv_head * dim, first + it.begin, dim, scale, scores.data(),
                          acc.data())) {
        auto slot_of = [&](int64_t p) {
          return static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        };
        for (int64_t p = 0; p < longest; ++p) {
          if (p + kKeysAhead < longest) {
            const int64_t ahead = (slot_of(p + kKeysAhead) * kv_heads + it.kv_head) * dim;
            for (int64_t b = 0; b < dim; b += 64 / static_cast<int64_t>(sizeof(C))) {
              __builtin_prefetch(kc + ahead + b);
              __builtin_prefetch(vc + ahead + b);
            }
          }
          const int64_t slot = slot_of(p);
          const C* k = kc + (slot * kv_heads + it.kv_head) * dim;
          // rows of token j see keys 0..first + j: skip the tokens that come before p
          const int64_t from = std::max<int64_t>(0, p - first - it.begin) * group;
          for (int64_t r = from; r < rows; ++r) {
            const float* x = &qf[r * dim];
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += x[d] * to_float(k[d]);
            scores[r * longest + p] = dot * scale;
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t n = first + it.begin + r / group + 1;
          float* row = &scores[r * longest];
          float top = -INFINITY;
          for (int64_t p = 0; p < n; ++p) top = std::max(top, row[p]);
          int64_t p = 0;
#if defined(__AVX2__) && defined(__FMA__)
          for (; p + 8 <= n; p += 8) {
            _mm256_storeu_ps(row + p, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + p),
                                                         _mm256_set1_ps(top))));
          }
#endif
          for (; p < n; ++p) row[p] = std::exp(row[p] - top);
          float sum = 0.0f;
          for (p = 0; p < n; ++p) sum += row[p];
          const float inv = 1.0f / sum;
          for (int64_t p = 0; p < n; ++p) row[p] *= inv;
        }
        for (int64_t p = 0; p < longest; ++p) {
          const C* v = vc + (slot_of(p) * kv_heads + it.kv_head) * dim;
          const int64_t from = std::max<int64_t>(0, p - first - it.begin) * group;
          for (int64_t r = from; r < rows; ++r) {
            const float w = scores[r * longest + p];
            float* a = &acc[r * dim];
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += w * to_float(v[d]);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = starts[it.seq] + it.begin + r / group;
        O* dst = o + token * o_row + (it.kv_head * group + r % group) * o_head;
        for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<O>(acc[r * dim + d]);
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale, at::Tensor out) {
  check_rows(query, "query");
  check_rows(out, "out");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "block_tables rows, seq_lens and query_start_loc must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "heads must be a multiple of kv heads");
  dispatch_float(query, "query", [&](auto q_type) {
    dispatch_float(key_cache, "key_cache", [&](auto c_type) {
      dispatch_float(out, "out", [&](auto o_type) {
        attention_kernel<decltype(q_type), decltype(c_type), decltype(o_type)>(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out);
      });
    });
  });
  return out;
}

// transformers' x * cos + rotate_half(x) * sin, rounding to T after each op as torch does.
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, int64_t half, float* y) {
  for (int64_t d = 0; d < 2 * half; ++d) {
    const float swapped = d < half ? -to_float(x[d + half]) : to_float(x[d - half]);
    const float a = to_float(from_float<T>(to_float(x[d]) * to_float(cos[d])));
    const float b = to_float(from_float<T>(swapped * to_float(sin[d])));
    y[d] = to_float(from_float<T>(a + b));
  }
}

template <typename T, typename C>
void rotary_cache_kernel(at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const int64_t tokens = query.size(0), heads = query.size(1), kv_heads = key.size(1);
  const int64_t dim = query.size(2), half = dim / 2;
  T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  C* kc = key_cache.data_ptr<C>();
  C* vc = value_cache.data_ptr<C>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t k_row = key.stride(0), k_head = key.stride(1);
  const int64_t v_row = value.stride(0), v_head = value.stride(1);
  const int64_t c_row = cos.stride(0), s_row = sin.stride(0);
  at::parallel_for(0, tokens, kInlineTokens, [&](int64_t lo, int64_t hi) {
    std::vector<float> y(dim);
    for (int64_t t = lo; t < hi; ++t) {
      const T* ct = c + t * c_row;
      const T* st = s + t * s_row;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = q + t * q_row + h * q_head;
        rotate(x, ct, st, half, y.data());
        for (int64_t d = 0; d < dim; ++d) x[d] = from_float<T>(y[d]);
      }
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(k + t * k_row + h * k_head, ct, st, half, y.data());
        C* kd = kc + (slot * kv_heads + h) * dim;
        C* vd = vc + (slot * kv_heads + h) * dim;
        const T* vs = v + t * v_row + h * v_head;
        for (int64_t d = 0; d < dim; ++d) {
          kd[d] = from_float<C>(y[d]);
          vd[d] = from_float<C>(to_float(vs[d]));
        }
      }
    }
  });
}

void rotary_and_cache(at::Tensor query, const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor key_cache,
                      at::Tensor value_cache, const at::Tensor& slot_mapping) {
  for (const at::Tensor& t : {query, key, value, cos, sin}) check_rows(t, "rotary input");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type() &&
                  cos.scalar_type() == query.scalar_type() &&
                  sin.scalar_type() == query.scalar_type(),
              "query, key, value, cos and sin must share a dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  TORCH_CHECK(query.size(2) % 2 == 0, "head_dim must be even");
  dispatch_float(query, "query", [&](auto t_type) {
    dispatch_float(key_cache, "key_cache", [&](auto c_type) {
      rotary_cache_kernel<decltype(t_type), decltype(c_type)>(
          query, key, value, cos, sin, key_cache, value_cache, slot_mapping);
    });
  });
}

// residual += x; returns rms_norm(residual) * weight in out's dtype (float32 statistics).
template <typename X, typename O>
void add_rms_norm_kernel(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps, at::Tensor& out) {
  const int64_t tokens = residual.size(0), width = residual.size(1);
  const X* xs = x.data_ptr<X>();
  float* res = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  O* o = out.data_ptr<O>();
  const int64_t x_row = x.stride(0), r_row = residual.stride(0), o_row = out.stride(0);
  at::parallel_for(0, tokens, kInlineTokens, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      float* r = res + t * r_row;
      const X* a = xs + t * x_row;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < width; ++d) {
        r[d] += to_float(a[d]);
        squares += r[d] * r[d];
      }
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(width) +
                                         static_cast<float>(eps));
      O* y = o + t * o_row;
      for (int64_t d = 0; d < width; ++d) y[d] = from_float<O>(w[d] * (r[d] * inv));
    }
  });
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps, at::Tensor out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(residual.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  residual.stride(-1) == 1 && weight.is_contiguous(),
              "residual and weight must be float32, contiguous in their last dimension");
  dispatch_float(x, "x", [&](auto x_type) {
    dispatch_float(out, "out", [&](auto o_type) {
      add_rms_norm_kernel<decltype(x_type), decltype(o_type)>(x, residual, weight, eps, out);
    });
  });
  return out;
}

template <typename X, typename O>
void silu_and_mul_kernel(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t tokens = out.size(0), width = out.size(1);
  const X* g = gate_up.data_ptr<X>();
  O* o = out.data_ptr<O>();
  const int64_t g_row = gate_up.stride(0), o_row = out.stride(0);
  at::parallel_for(0, tokens, kInlineTokens, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const X* gate = g + t * g_row;
      const X* up = gate + width;
      O* y = o + t * o_row;
      int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; d + 8 <= width; d += 8) {
        const __m256 a = load8(gate + d);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
        store8(y + d, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                    load8(up + d)));
      }
#endif
      for (; d < width; ++d) {
        const float a = to_float(gate[d]);
        y[d] = from_float<O>(a / (1.0f + std::exp(-a)) * to_float(up[d]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up, at::Tensor out) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  TORCH_CHECK(gate_up.size(1) == 2 * out.size(1), "gate_up must be twice out's width");
  dispatch_float(gate_up, "gate_up", [&](auto x_type) {
    dispatch_float(out, "out", [&](auto o_type) {
      silu_and_mul_kernel<decltype(x_type), decltype(o_type)>(gate_up, out);
    });
  });
  return out;
}

// The integer dot products' instruction set ("" where only the plain loops run).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define CHATGATE_VNNI 1
constexpr const char* kIntegerDots = "avx512-vnni";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CHATGATE_AVX2 1
constexpr const char* kIntegerDots = "avx2";

inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Four-product integer sums per 32-bit lane of unsigned ``w`` (each below 128) times signed
// ``q``: what dpbusd computes, here without saturating the 16-bit pairs.
inline __m256i dot_u8_s8(__m256i w, __m256i q) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), _mm256_set1_epi16(1));
}
#else
constexpr const char* kIntegerDots = "";
#endif

constexpr int64_t kGroup = 32;
constexpr int64_t kPair = 2 * kGroup;  // the weights pack two groups in 32 bytes

#if defined(CHATGATE_VNNI)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const BF16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// One group of 32 as quantize_rows' loop computes it, the same bits: the maximum is exact in
// any order, and the conversion rounds to nearest even as std::nearbyint does.
template <typename X>
inline void quantize_group(const X* src, int8_t* dst, float* d, float* sum) {
  const __m512 a = load16(src), b = load16(src + 16);
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float step = top / 127.0f;
  const __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qb));
  *d = step;
  *sum = step * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
}
#elif defined(CHATGATE_AVX2)
// One group of 32 as quantize_rows' loop computes it, the same bits (as with AVX512-VNNI).
template <typename X>
inline void quantize_group(const X* src, int8_t* dst, float* d, float* sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(src + 8 * i);
    top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
  }
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  const float peak = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  const float step = peak / 127.0f;
  const __m256 inv = _mm256_set1_ps(peak > 0.0f ? 127.0f / peak : 0.0f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // packs interleave 128-bit lanes: bytes come out as quads of q0..q3's first halves, then
  // their second halves; the permutation puts each vector's eight back together
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                           _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(bytes,
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i total =
      _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  *d = step;
  *sum = step * static_cast<float>(_mm_cvtsi128_si32(h));
}
#endif

// x [rows, k] as int8 codes per group of 32 with the group's step d and d * sum(codes).
template <typename X>
void quantize_rows(const X* x, int64_t x_row, int64_t rows, int64_t k, int8_t* q, float* d,
                   float* sums) {
  const int64_t groups = k / kGroup;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const X* src = x + m * x_row + g * kGroup;
#if defined(CHATGATE_VNNI) || defined(CHATGATE_AVX2)
      quantize_group(src, q + (m * groups + g) * kGroup, d + m * groups + g, sums + m * groups + g);
#else
      float top = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j) top = std::max(top, std::fabs(to_float(src[j])));
      const float step = top / 127.0f;
      const float inv = top > 0.0f ? 127.0f / top : 0.0f;
      int32_t total = 0;
      int8_t* dst = q + (m * groups + g) * kGroup;
      for (int64_t j = 0; j < kGroup; ++j) {
        dst[j] = static_cast<int8_t>(std::nearbyint(to_float(src[j]) * inv));
        total += dst[j];
      }
      d[m * groups + g] = step;
      sums[m * groups + g] = step * static_cast<float>(total);
#endif
    }
  }
}

// The activations of one product, quantized by quantize_rows: row m's codes at q[m * k], its
// groups' steps and step * sum(codes) at d[m * groups] and sums[m * groups].
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, sums;

  explicit QuantizedRows(const at::Tensor& x)
      : q(x.size(0) * x.size(1)), d(x.size(0) * (x.size(1) / kGroup)), sums(d.size()) {
    dispatch_float(x, "x", [&](auto x_type) {
      quantize_rows(x.data_ptr<decltype(x_type)>(), x.stride(0), x.size(0), x.size(1), q.data(),
                    d.data(), sums.data());
    });
  }
};

inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// Calls ``pair(group, slot)`` for each pair of groups in order, alternating two accumulator
// slots (two independent chains of float additions).
template <typename Pair>
inline void over_pairs(int64_t groups, Pair&& pair) {
  int64_t p = 0;
  for (; p + 4 <= groups; p += 4) {
    pair(p, 0);
    pair(p + 2, 1);
  }
  if (p < groups) pair(p, 0);
}

// The minimum's part of one weight row times one activation row, sum(minimum * d * sum(q)),
// and each group's combined step scale * d into ``step``.
inline float int4_offset_and_steps(const at::Half* scale, const at::Half* minimum,
                                   int64_t groups, const float* d, const float* sums,
                                   float* step) {
  int64_t g = 0;
  float offset = 0.0f;
#if defined(CHATGATE_VNNI)
  __m512 offsets = _mm512_setzero_ps();
  for (; g + 16 <= groups; g += 16) {
    const __m512 s = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g)));
    const __m512 m = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum + g)));
    _mm512_storeu_ps(step + g, _mm512_mul_ps(s, _mm512_loadu_ps(d + g)));
    offsets = _mm512_fmadd_ps(m, _mm512_loadu_ps(sums + g), offsets);
  }
  offset = _mm512_reduce_add_ps(offsets);
#elif defined(CHATGATE_AVX2)
  __m256 offsets = _mm256_setzero_ps();
  for (; g + 8 <= groups; g += 8) {
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + g)));
    const __m256 m =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minimum + g)));
    _mm256_storeu_ps(step + g, _mm256_mul_ps(s, _mm256_loadu_ps(d + g)));
    offsets = _mm256_fmadd_ps(m, _mm256_loadu_ps(sums + g), offsets);
  }
  offset = reduce_add(offsets);
#endif
  for (; g < groups; ++g) {
    step[g] = half_to_float(scale[g]) * d[g];
    offset += half_to_float(minimum[g]) * sums[g];
  }
  return offset;
}

// One weight row against R quantized activation rows (row r at q + r * q_row, its steps and
// sums at r * groups), written to out[0..R). Each row's arithmetic is the same for every R, so
// a row's result does not depend on how many rows share the call. ``codes``: 32 bytes per two
// groups, element e (0..63) of the pair in byte e % 32, low nibble for e < 32. ``step``:
// scratch of R * groups floats.
template <int R>
inline void int4_dot_rows(const uint8_t* codes, const at::Half* scale, const at::Half* minimum,
                          int64_t groups, const int8_t* q, int64_t q_row, const float* d,
                          const float* sums, float* step, float* out) {
  float offset[R];
  for (int r = 0; r < R; ++r) {
    offset[r] = int4_offset_and_steps(scale, minimum, groups, d + r * groups,
                                      sums + r * groups, step + r * groups);
  }
#if defined(CHATGATE_VNNI)
  const __m256i low_bits = _mm256_set1_epi8(0x0F);
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  auto pair = [&](int64_t at, int slot) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + at * 16));
    const __m512i w = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(packed, low_bits)),
        _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_bits), 1);
    for (int r = 0; r < R; ++r) {
      const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                               _mm512_loadu_si512(q + r * q_row + at * kGroup));
      const __m512 steps = _mm512_permutexvar_ps(
          halves, _mm512_castpd_ps(_mm512_castpd128_pd512(_mm_load_sd(
                      reinterpret_cast<const double*>(step + r * groups + at)))));
      acc[r][slot] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), steps, acc[r][slot]);
    }
  };
  over_pairs(groups, pair);
  for (int r = 0; r < R; ++r) {
    out[r] = offset[r] + _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
  }
#elif defined(CHATGATE_AVX2)
  const __m256i low_bits = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  auto pair = [&](int64_t at, int slot) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + at * 16));
    const __m256i w[2] = {_mm256_and_si256(packed, low_bits),
                          _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_bits)};
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        const __m256i dots = dot_u8_s8(w[h], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                 q + r * q_row + (at + h) * kGroup)));
        acc[r][slot] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots),
                                       _mm256_broadcast_ss(step + r * groups + at + h),
                                       acc[r][slot]);
      }
    }
  };
  over_pairs(groups, pair);
  for (int r = 0; r < R; ++r) out[r] = offset[r] + reduce_add(_mm256_add_ps(acc[r][0], acc[r][1]));
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int64_t j = 0; j < kGroup; ++j) {
        const int64_t e = (g % 2) * kGroup + j;  // the element's place in its pair
        const uint8_t byte = codes[(g / 2) * 32 + e % 32];
        dot += (e < 32 ? byte & 0x0F : byte >> 4) * q[r * q_row + g * kGroup + j];
      }
      total += static_cast<float>(dot) * step[r * groups + g];
    }
    out[r] = offset[r] + total;
  }
#endif
}

constexpr int64_t kTile = 4;   // activation rows per pass over a weight row
constexpr int64_t kAhead = 8;  // weight rows prefetched ahead
// activation rows per sweep over a thread's weight rows: the sweep's int8 rows stay in L1/L2
// while its weights stream (prefill steps have thousands of rows)
constexpr int64_t kBlock = 32;

template <typename O>
void int4_linear_kernel(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& minimums, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0), groups = k / kGroup;
  const QuantizedRows act(x);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  const at::Half* mn = minimums.data_ptr<at::Half>();
  O* o = out.data_ptr<O>();
  const int64_t o_row = out.stride(0);
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    std::vector<float> step(kTile * groups);
    float result[kTile];
    for (int64_t block = 0; block < rows; block += kBlock) {
      const int64_t block_end = std::min(rows, block + kBlock);
      for (int64_t i = lo; i < hi; ++i) {
        if (i + kAhead < hi) {
          const uint8_t* ahead = c + (i + kAhead) * groups * 16;
          for (int64_t b = 0; b < groups * 16; b += 64) __builtin_prefetch(ahead + b);
          __builtin_prefetch(sc + (i + kAhead) * groups);
          __builtin_prefetch(mn + (i + kAhead) * groups);
        }
        const uint8_t* row = c + i * groups * 16;
        for (int64_t m = block; m < block_end;) {
          const int64_t tile = block_end - m >= kTile ? kTile : 1;
          const int8_t* qm = act.q.data() + m * k;
          if (tile == kTile) {
            int4_dot_rows<kTile>(row, sc + i * groups, mn + i * groups, groups, qm, k,
                                 act.d.data() + m * groups, act.sums.data() + m * groups,
                                 step.data(), result);
          } else {
            int4_dot_rows<1>(row, sc + i * groups, mn + i * groups, groups, qm, k,
                             act.d.data() + m * groups, act.sums.data() + m * groups, step.data(),
                             result);
          }
          for (int64_t r = 0; r < tile; ++r) o[(m + r) * o_row + i] = from_float<O>(result[r]);
          m += tile;
        }
      }
    }
  });
}

constexpr int64_t kInterleave = 8;
constexpr int64_t kBlocksAhead = 4;  // blocks of 8 weight rows prefetched ahead

#if defined(CHATGATE_AVX2)
// AVX2 takes int4 weights interleaved by blocks of 8 output rows: one 32-bit lane per row, so a
// group's products sum within lanes (no horizontal sums) and a register of weights serves every
// activation row of the tile. Per (block, group): 4 chunks of 32 bytes, byte r * 4 + i of chunk
// c holding row r's codes for inputs 4c + i (low nibble) and 16 + 4c + i (high nibble); then
// the block's scales and minimums as [group][8 rows].

inline bool interleaved(int64_t n) { return n % kInterleave == 0; }

// Activation rows [R] times one block of 8 weight rows: out[r * 8 + j] for weight row j.
// Each row's arithmetic is the same for every R.
template <int R>
inline void int4_block_rows(const uint8_t* codes, const at::Half* scale, const at::Half* minimum,
                            int64_t groups, const int8_t* q, int64_t q_row, const float* d,
                            const float* sums, float* out) {
  const __m256i low_bits = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* chunk = codes + g * 128;
    // 16-bit sums of 16 products each: |sum| <= 16 * 15 * 127 < 2^15
    __m256i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + c * 32));
      const __m256i low = _mm256_and_si256(packed, low_bits);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_bits);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = q + r * q_row + g * kGroup + 4 * c;
        int32_t first, second;
        std::memcpy(&first, x, 4);
        std::memcpy(&second, x + 16, 4);
        dots[r] = _mm256_add_epi16(dots[r], _mm256_maddubs_epi16(low, _mm256_set1_epi32(first)));
        dots[r] =
            _mm256_add_epi16(dots[r], _mm256_maddubs_epi16(high, _mm256_set1_epi32(second)));
      }
    }
    const __m256 s =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + g * 8)));
    const __m256 m =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minimum + g * 8)));
    for (int r = 0; r < R; ++r) {
      const __m256 step = _mm256_mul_ps(s, _mm256_broadcast_ss(d + r * groups + g));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dots[r], ones)), step, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(sums + r * groups + g), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kInterleave, acc[r]);
}

template <typename O>
void int4_interleaved_kernel(const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& scales, const at::Tensor& minimums,
                             at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0), groups = k / kGroup;
  const QuantizedRows act(x);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  const at::Half* mn = minimums.data_ptr<at::Half>();
  O* o = out.data_ptr<O>();
  const int64_t o_row = out.stride(0), block_bytes = groups * 128, block_groups = groups * 8;
  at::parallel_for(0, n / kInterleave, 8, [&](int64_t lo, int64_t hi) {
    float result[kTile * kInterleave];
    for (int64_t sweep = 0; sweep < rows; sweep += kBlock) {
      const int64_t sweep_end = std::min(rows, sweep + kBlock);
      for (int64_t b = lo; b < hi; ++b) {
        if (b + kBlocksAhead < hi) {  // weights a few blocks ahead while this one computes
          const int64_t next = b + kBlocksAhead;
          for (int64_t at = 0; at < block_bytes; at += 64) {
            __builtin_prefetch(c + next * block_bytes + at);
          }
          for (int64_t at = 0; at < block_groups; at += 32) {
            __builtin_prefetch(sc + next * block_groups + at);
            __builtin_prefetch(mn + next * block_groups + at);
          }
        }
        for (int64_t m = sweep; m < sweep_end;) {
          const int64_t tile = sweep_end - m >= kTile ? kTile : 1;
          const int8_t* qm = act.q.data() + m * k;
          if (tile == kTile) {
            int4_block_rows<kTile>(c + b * block_bytes, sc + b * block_groups,
                                   mn + b * block_groups, groups, qm, k, act.d.data() + m * groups,
                                   act.sums.data() + m * groups, result);
          } else {
            int4_block_rows<1>(c + b * block_bytes, sc + b * block_groups,
                               mn + b * block_groups, groups, qm, k, act.d.data() + m * groups,
                               act.sums.data() + m * groups, result);
          }
          for (int64_t r = 0; r < tile; ++r) {
            for (int64_t j = 0; j < kInterleave; ++j) {
              o[(m + r) * o_row + b * kInterleave + j] = from_float<O>(result[r * kInterleave + j]);
            }
          }
          m += tile;
        }
      }
    }
  });
}
#else
inline bool interleaved(int64_t) { return false; }
#endif

// ``codes [n, k]`` (uint8, 0..15) with float16 ``scales`` and ``minimums`` [n, k / 32], packed
// as int4_linear takes them: two groups per 32 bytes (element e of the pair in byte e % 32,
// the low nibble for e < 32), or with AVX2 interleaved by blocks of 8 rows (see above). The
// packed tensors keep the shapes [n, k / 2] and [n, k / 32].
std::vector<at::Tensor> int4_pack(const at::Tensor& codes, const at::Tensor& scales,
                                  const at::Tensor& minimums) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.size(1) % kPair == 0,
              "codes must be uint8 [n, k] with k a multiple of 64");
  const int64_t n = codes.size(0), k = codes.size(1), groups = k / kGroup;
  const at::Tensor w = codes.contiguous();
  const at::Tensor s = scales.to(at::kHalf).contiguous(), m = minimums.to(at::kHalf).contiguous();
  TORCH_CHECK(s.numel() == n * groups && m.numel() == n * groups,
              "scales and minimums must be [n, k / 32]");
  at::Tensor packed = at::empty({n, k / 2}, w.options());
  at::Tensor packed_s = at::empty({n, groups}, s.options()), packed_m = at::empty_like(packed_s);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const bool blocks = interleaved(n);
  for (int64_t row = 0; row < n; ++row) {
    const uint8_t* in = src + row * k;
    if (blocks) {
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* chunks = dst + ((row / kInterleave) * groups + g) * 128 + (row % kInterleave) * 4;
        for (int64_t c = 0; c < 4; ++c) {
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t* first = in + g * kGroup + 4 * c + i;
            chunks[c * 32 + i] = static_cast<uint8_t>(first[0] | (first[16] << 4));
          }
        }
      }
    } else {
      for (int64_t j = 0; j < k / 2; ++j) {  // byte j % 32 of pair j / 32
        const uint8_t* first = in + (j / 32) * kPair + j % 32;
        dst[row * (k / 2) + j] = static_cast<uint8_t>(first[0] | (first[kGroup] << 4));
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t to = blocks ? ((row / kInterleave) * groups + g) * kInterleave +
                                      row % kInterleave
                                : row * groups + g;
      packed_s.data_ptr<at::Half>()[to] = s.data_ptr<at::Half>()[row * groups + g];
      packed_m.data_ptr<at::Half>()[to] = m.data_ptr<at::Half>()[row * groups + g];
    }
  }
  return {packed, packed_s, packed_m};
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& minimums, at::Tensor out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) % kPair == 0, "int4_linear: input width must be a multiple of 64");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) == x.size(1) / 2,
              "codes must be contiguous uint8 [n, k / 2]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && minimums.scalar_type() == at::kHalf &&
                  scales.is_contiguous() && minimums.is_contiguous(),
              "scales and minimums must be contiguous float16 [n, k / 32]");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == codes.size(0), "out must be [rows, n]");
  dispatch_float(out, "out", [&](auto o_type) {
#if defined(CHATGATE_AVX2)
    if (interleaved(codes.size(0))) {
      int4_interleaved_kernel<decltype(o_type)>(x, codes, scales, minimums, out);
      return;
    }
#endif
    int4_linear_kernel<decltype(o_type)>(x, codes, scales, minimums, out);
  });
  return out;
}

// One row of int8 weights stored as unsigned (w + 128) against R quantized activation rows:
// for each, the sum over groups of d[g] * dot(w + 128, q) (the caller removes the
// 128 * sum(q) part: kUnsignedBias). AVX2 multiplies |w| by q with w's sign instead (unsigned
// codes up to 255 would saturate its 16-bit pairs), so there the sum is of d[g] * dot(w, q).
// ``steps``: each row's pairs of groups' steps spread over 16 lanes.
// As for int4, each row's arithmetic is the same for every R.
template <int R>
inline void int8_dot_rows(const uint8_t* codes, int64_t groups, const int8_t* q, int64_t q_row,
                          const float* steps, int64_t steps_row, float* out) {
#if defined(CHATGATE_VNNI)
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  auto pair = [&](int64_t at, int slot) {
    const __m512i w = _mm512_loadu_si512(codes + at * kGroup);
    for (int r = 0; r < R; ++r) {
      const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                               _mm512_loadu_si512(q + r * q_row + at * kGroup));
      acc[r][slot] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots),
                                     _mm512_loadu_ps(steps + r * steps_row + at * 8),
                                     acc[r][slot]);
    }
  };
  over_pairs(groups, pair);
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#elif defined(CHATGATE_AVX2)
  const __m256i sign_bit = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  auto pair = [&](int64_t at, int slot) {
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_xor_si256(  // w + 128 back to w (|w| <= 127)
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (at + h) * kGroup)),
          sign_bit);
      const __m256i magnitude = _mm256_abs_epi8(w);
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(q + r * q_row + (at + h) * kGroup));
        const __m256i dots = dot_u8_s8(magnitude, _mm256_sign_epi8(x, w));
        acc[r][slot] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots),
                                       _mm256_loadu_ps(steps + r * steps_row + at * 8 + h * 8),
                                       acc[r][slot]);
      }
    }
  };
  over_pairs(groups, pair);
  for (int r = 0; r < R; ++r) out[r] = reduce_add(_mm256_add_ps(acc[r][0], acc[r][1]));
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int64_t j = 0; j < kGroup; ++j) {
        dot += codes[g * kGroup + j] * q[r * q_row + g * kGroup + j];
      }
      total += static_cast<float>(dot) * steps[r * steps_row + (g / 2) * 16 + (g % 2) * 8];
    }
    out[r] = total;
  }
#endif
}

#if defined(CHATGATE_AVX2)
constexpr bool kUnsignedBias = false;
#else
constexpr bool kUnsignedBias = true;
#endif

// Four int8 codes as one 32-bit word (to broadcast).
inline int32_t load_quad(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return v;
}

#if defined(CHATGATE_VNNI)
// With AVX512-VNNI, int8 weights of n % 16 == 0 rows are blocked by 16 output rows (int8_pack):
// one 32-bit lane per output row, so a group's products sum within lanes (no horizontal sums)
// and one register of weights serves every activation row of the tile. Block b, inputs 4c..4c+3
// (quad c): 64 bytes at (b * k / 4 + c) * 64, row j's four codes at byte 4j.
constexpr int64_t kLanes = 16;
constexpr int64_t kRowsTile = 8;  // most activation rows per pass over a block
using Int8Lanes = __m512;

// Activation rows [R] times one block of 16 weight rows: per group, the integer dot products
// of its 8 quads, then acc += dot * step (the row's group step d). Each row's arithmetic is the
// same for every R. ``ahead``: the next block's weights, prefetched group by group (or null).
template <int R>
inline void int8_block_rows(const uint8_t* w, int64_t groups, const int8_t* q, int64_t q_row,
                            const float* d, int64_t d_row, const uint8_t* ahead, __m512* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * kGroup * kLanes;
    if (ahead != nullptr) {
      for (int64_t b = 0; b < kGroup * kLanes; b += 64) {
        __builtin_prefetch(ahead + g * kGroup * kLanes + b);
      }
    }
    __m512i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm512_setzero_si512();
    for (int64_t c = 0; c < kGroup / 4; ++c) {
      const __m512i wv = _mm512_loadu_si512(wg + c * 64);
      for (int r = 0; r < R; ++r) {
        dots[r] = _mm512_dpbusd_epi32(
            dots[r], wv, _mm512_set1_epi32(load_quad(q + r * q_row + g * kGroup + c * 4)));
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_set1_ps(d[r * d_row + g]),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// A block's kLanes results of one activation row: scale * (acc - bias).
inline void int8_scaled(float* lanes, const float* scale, __m512 acc, float bias) {
  _mm512_store_ps(lanes, _mm512_mul_ps(_mm512_loadu_ps(scale),
                                       _mm512_sub_ps(acc, _mm512_set1_ps(bias))));
}
#elif defined(CHATGATE_AVX2)
// With AVX2, int8 weights of n % 8 == 0 rows are blocked by 8 output rows as with AVX512-VNNI
// by 16: a group's integer dot product is exact before its one conversion to float. Block b,
// quad c: 32 bytes at (b * k / 4 + c) * 32, row j's four codes at byte 4j.
constexpr int64_t kLanes = 8;
constexpr int64_t kRowsTile = 4;  // most activation rows per pass over a block (16 registers)
using Int8Lanes = __m256;

// Activation rows [R] times one block of 8 weight rows, as int8_block_rows with AVX512-VNNI:
// maddubs multiplies |w| by q with w's sign (unsigned codes up to 255 would saturate its 16-bit
// pairs). Each row's arithmetic is the same for every R.
template <int R>
inline void int8_block_rows(const uint8_t* w, int64_t groups, const int8_t* q, int64_t q_row,
                            const float* d, int64_t d_row, const uint8_t* ahead, __m256* out) {
  const __m256i sign_bit = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * kGroup * kLanes;
    if (ahead != nullptr) {
      for (int64_t b = 0; b < kGroup * kLanes; b += 64) {
        __builtin_prefetch(ahead + g * kGroup * kLanes + b);
      }
    }
    __m256i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < kGroup / 4; ++c) {
      const __m256i wv = _mm256_xor_si256(  // w + 128 back to w (|w| <= 127)
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 32)), sign_bit);
      const __m256i magnitude = _mm256_abs_epi8(wv);
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(load_quad(q + r * q_row + g * kGroup + c * 4));
        dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                 magnitude, _mm256_sign_epi8(x, wv)), ones));
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_set1_ps(d[r * d_row + g]),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// A block's kLanes results of one activation row: scale * (acc - bias).
inline void int8_scaled(float* lanes, const float* scale, __m256 acc, float bias) {
  _mm256_store_ps(lanes, _mm256_mul_ps(_mm256_loadu_ps(scale),
                                       _mm256_sub_ps(acc, _mm256_set1_ps(bias))));
}
#endif

#if defined(CHATGATE_VNNI) || defined(CHATGATE_AVX2)
// A product of fewer weights than this runs on the calling thread: up to kRowsTile rows stream
// the weights once (each row past them counts as 1 / kRowsTile pass more), and streaming half
// a megabyte takes about as long as waking a second thread.
constexpr int64_t kParallelWeights = 1 << 19;
inline bool int8_blocked(int64_t n) { return n % kLanes == 0; }

// int8_block_rows<tile> for a tile of 1..R rows.
template <int R>
inline void int8_tile_rows(int tile, const uint8_t* w, int64_t groups, const int8_t* q,
                           int64_t q_row, const float* d, const uint8_t* ahead, Int8Lanes* out) {
  if (tile == R) {
    int8_block_rows<R>(w, groups, q, q_row, d, groups, ahead, out);
  } else if constexpr (R > 1) {
    int8_tile_rows<R - 1>(tile, w, groups, q, q_row, d, ahead, out);
  }
}

template <typename O>
void int8_blocked_kernel(const QuantizedRows& act, const std::vector<float>& bias,
                         const at::Tensor& codes, const at::Tensor& row_scales, at::Tensor& out) {
  const int64_t rows = out.size(0), n = codes.size(0), k = codes.size(1), groups = k / kGroup;
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* scale = row_scales.data_ptr<float>();
  O* o = out.data_ptr<O>();
  const int64_t o_row = out.stride(0), block_bytes = kLanes * k, blocks = n / kLanes;
  const int64_t passes = kRowsTile + std::max<int64_t>(0, rows - kRowsTile);  // in 1 / kRowsTile
  const bool small = n * k * passes / kRowsTile < kParallelWeights;
  at::parallel_for(0, blocks, small ? blocks + 1 : 64 / kLanes, [&](int64_t lo, int64_t hi) {
    Int8Lanes result[kRowsTile];
    alignas(64) float lanes[kLanes];
    for (int64_t sweep = 0; sweep < rows; sweep += kBlock) {  // kBlock rows stay in L1/L2
      const int64_t sweep_end = std::min(rows, sweep + kBlock);
      for (int64_t b = lo; b < hi; ++b) {
        const uint8_t* w = c + b * block_bytes;
        for (int64_t m = sweep; m < sweep_end;) {
          const int tile = static_cast<int>(std::min(sweep_end - m, kRowsTile));  // one pass
          const uint8_t* ahead = m == sweep && b + 1 < hi ? w + block_bytes : nullptr;
          int8_tile_rows<kRowsTile>(tile, w, groups, act.q.data() + m * k, k,
                                    act.d.data() + m * groups, ahead, result);
          for (int r = 0; r < tile; ++r) {
            int8_scaled(lanes, scale + b * kLanes, result[r], bias[m + r]);
            O* dst = o + (m + r) * o_row + b * kLanes;
            for (int64_t j = 0; j < kLanes; ++j) dst[j] = from_float<O>(lanes[j]);
          }
          m += tile;
        }
      }
    }
  });
}
#else
constexpr int64_t kLanes = 1;
inline bool int8_blocked(int64_t) { return false; }
#endif

// ``codes [n, k]`` (uint8, w + 128) as int8_linear takes them: with AVX512-VNNI and n % 16 == 0
// blocked by 16 rows, with AVX2 and n % 8 == 0 by 8 (see above; same shape), else unchanged.
// int8_unpack undoes it.
at::Tensor int8_pack(const at::Tensor& codes) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.size(1) % 4 == 0,
              "codes must be uint8 [n, k] with k a multiple of 4");
  const int64_t n = codes.size(0), k = codes.size(1);
  if (!int8_blocked(n)) return codes.contiguous();
  return codes.view({n / kLanes, kLanes, k / 4, 4}).permute({0, 2, 1, 3}).contiguous().view(
      {n, k});
}

at::Tensor int8_unpack(const at::Tensor& packed) {
  const int64_t n = packed.size(0), k = packed.size(1);
  if (!int8_blocked(n)) return packed;
  return packed.view({n / kLanes, k / 4, kLanes, 4}).permute({0, 2, 1, 3}).contiguous().view(
      {n, k});
}

template <typename O>
void int8_linear_kernel(const at::Tensor& x, const at::Tensor& codes,
                        const at::Tensor& row_scales, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0), groups = k / kGroup;
  const QuantizedRows act(x);
  std::vector<float> bias(rows, 0.0f);  // 128 * sum(x): what unsigned weights add
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups && kUnsignedBias; ++g) bias[m] += 128.0f * act.sums[m * groups + g];
  }
#if defined(CHATGATE_VNNI) || defined(CHATGATE_AVX2)
  if (int8_blocked(n)) {
    int8_blocked_kernel<O>(act, bias, codes, row_scales, out);
    return;
  }
#endif
  std::vector<float> steps(rows * groups * 8);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      std::fill_n(&steps[(m * groups / 2 + g / 2) * 16 + (g % 2) * 8], 8, act.d[m * groups + g]);
    }
  }
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* scale = row_scales.data_ptr<float>();
  O* o = out.data_ptr<O>();
  const int64_t o_row = out.stride(0), steps_row = groups * 8;
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    float result[kTile];
    for (int64_t block = 0; block < rows; block += kBlock) {
      const int64_t block_end = std::min(rows, block + kBlock);
      for (int64_t i = lo; i < hi; ++i) {
        if (i + kAhead < hi) {
          for (int64_t b = 0; b < k; b += 64) __builtin_prefetch(c + (i + kAhead) * k + b);
        }
        for (int64_t m = block; m < block_end;) {
          const int64_t tile = block_end - m >= kTile ? kTile : 1;
          const int8_t* qm = act.q.data() + m * k;
          const float* sm = steps.data() + m * steps_row;
          if (tile == kTile) {
            int8_dot_rows<kTile>(c + i * k, groups, qm, k, sm, steps_row, result);
          } else {
            int8_dot_rows<1>(c + i * k, groups, qm, k, sm, steps_row, result);
          }
          for (int64_t r = 0; r < tile; ++r) {
            o[(m + r) * o_row + i] = from_float<O>(scale[i] * (result[r] - bias[m + r]));
          }
          m += tile;
        }
      }
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes,
                       const at::Tensor& row_scales, at::Tensor out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) % kPair == 0, "int8_linear: input width must be a multiple of 64");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) == x.size(1),
              "codes must be contiguous uint8 [n, k] (weights + 128)");
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.is_contiguous(),
              "row_scales must be contiguous float32 [n]");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == codes.size(0), "out must be [rows, n]");
  dispatch_float(out, "out", [&](auto o_type) {
    int8_linear_kernel<decltype(o_type)>(x, codes, row_scales, out);
  });
  return out;
}

// One quantized linear layer as int4_linear or int8_linear take it: int4 ``codes`` with float16
// ``scales`` and ``minimums`` per group, or int8 ``codes`` (w + 128) with float32 row
// ``scales`` and no minimums.
struct Product {
  at::Tensor codes, scales;
  std::optional<at::Tensor> minimums;

  // x's product, in x's dtype.
  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options());
    return minimums ? int4_linear(x, codes, scales, *minimums, out)
                    : int8_linear(x, codes, scales, out);
  }
};

struct Layer {
  Product qkv, o, gate_up, down;
  at::Tensor post_norm, next_norm;  // the next norm: the next layer's input norm or the final
};

// The decoder layers of engine/model.py's quantized CPU path. forward() takes the first layer's
// normed input ``x`` (bfloat16) and the residual stream ``h`` (float32, updated in place), and
// returns the final norm's output in ``dtype``.
class DecoderStack {
 public:
  DecoderStack(const std::vector<std::vector<std::optional<at::Tensor>>>& layers, int64_t heads,
               int64_t kv_heads, int64_t head_dim, double eps, double scale, at::ScalarType dtype)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        dtype_(dtype) {
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 14, "a layer is 4 x (codes, scales, minimums or None) + 2 norms");
      auto product = [&](size_t i) { return Product{t[i].value(), t[i + 1].value(), t[i + 2]}; };
      layers_.push_back(
          Layer{product(0), product(3), product(6), product(9), t[12].value(), t[13].value()});
    }
  }

  at::Tensor forward(at::Tensor x, at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc) const {
    TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.size(1) == (int64_t)layers_.size(),
                "kv_cache must be contiguous [2, layers, blocks, block_size, kv_heads, dim]");
    const int64_t n = x.size(0), q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
    const at::Tensor slots = slot_mapping.to(at::kLong);
    for (size_t index = 0; index < layers_.size(); ++index) {
      const Layer& layer = layers_[index];
      const at::Tensor qkv = layer.qkv(x).to(dtype_);
      const at::Tensor q = qkv.narrow(1, 0, q_width).view({n, heads_, head_dim_});
      const at::Tensor k = qkv.narrow(1, q_width, kv_width).view({n, kv_heads_, head_dim_});
      const at::Tensor v =
          qkv.narrow(1, q_width + kv_width, kv_width).view({n, kv_heads_, head_dim_});
      const at::Tensor key_cache = kv_cache.select(0, 0).select(0, index);
      const at::Tensor value_cache = kv_cache.select(0, 1).select(0, index);
      rotary_and_cache(q, k, v, cos, sin, key_cache, value_cache, slots);
      const at::Tensor attention =
          paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                          scale_, at::empty_like(q));
      x = add_rms_norm(layer.o(attention.view({n, q_width})), h, layer.post_norm, eps_,
                       at::empty(h.sizes(), h.options().dtype(at::kBFloat16)));
      const at::Tensor gate_up = layer.gate_up(x);
      const at::Tensor gated = silu_and_mul(
          gate_up, at::empty({n, gate_up.size(1) / 2}, gate_up.options()));
      const bool last = index + 1 == layers_.size();
      x = add_rms_norm(layer.down(gated), h, layer.next_norm, eps_,
                       at::empty(h.sizes(), h.options().dtype(last ? dtype_ : at::kBFloat16)));
    }
    return x;
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  at::ScalarType dtype_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention);
  m.def("rotary_and_cache", &rotary_and_cache);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("int4_linear", &int4_linear);
  m.def("int4_pack", &int4_pack);
  m.def("int8_linear", &int8_linear);
  m.def("int8_pack", &int8_pack);
  m.def("int8_unpack", &int8_unpack);
  m.attr("integer_dots") = kIntegerDots;
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<const std::vector<std::vector<std::optional<at::Tensor>>>&, int64_t,
                          int64_t, int64_t, double, double, at::ScalarType>())
      .def("forward", &DecoderStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
