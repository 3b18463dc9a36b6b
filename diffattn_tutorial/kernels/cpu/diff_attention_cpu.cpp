// Differential attention on a CPU, forward and backward, fused: naive's arithmetic in one pass per block of query
// rows (the backward: below diff_attention_cpu_forward).
//
// Why a kernel of its own: every SDPA formulation of differential attention does twice the multiply-adds of
// the naive one (q.k twice, or at width 2d, and P @ V once per map), because SDPA must apply V to each map
// separately. The naive formulation forms (A1 - lam A2) first and applies V once, but it writes both maps to
// memory (B * 2H * Nq * Nk floats). This kernel keeps naive's arithmetic and keeps the maps in cache:
//
//   for each work item (batch b, head h, block of BQ query rows), on one thread:
//     S1 = q1 . k1^T s, S2 = q2 . k2^T s    score tiles, all keys the block may see (BQ x Nk, in L2)
//     S += mask; P_m = exp2((S_m - rowmax) * LOG2E)   softmax numerators e^(S - max), row sums l1, l2
//     P = P1 / l1 - lam * P2 / l2             the differential map, in place of P1
//     O = P . V                               V applied once, in chunks of JV keys kept in L1
//
// Work items go to threads through one atomic counter, so a core that another program keeps busy simply
// takes fewer items (no thread waits for another at a barrier). Each row is computed by one thread in a
// fixed order, so the output does not depend on the thread count. The threads are torch's own where they can be:
// built with OpenMP and loaded into a process whose one OpenMP runtime is torch's, the kernel runs on that
// runtime's thread pool (diff_attention_cpu_use_openmp), whose threads are still spinning from torch's last
// parallel call; threads of the kernel's own would share the cores with them. Otherwise, and in a child forked
// after the library was loaded (GNU OpenMP's pool does not survive fork), it starts threads per call.
//
// The scores and the mask stay in natural units, as naive's (S + mask, then S - rowmax): an additive mask
// anywhere in float32's range gives naive's answer (converting it to base-2 units first would overflow beyond
// about 2.4e38); only the difference to the row's maximum is multiplied by LOG2E, for exp2.
//
// The Python side (diffattn_tutorial/kernels/cpu/boundary.py) passes each call as structs (Inputs, ForwardArgs,
// BackwardArgs below; ctypes Structures there mirror them field by field, checked against
// diff_attention_cpu_fields): float32 q, k, v with contiguous rows (a head width that is a multiple of 32,
// zero-padded there if need be) and the strides of their batch, head and row dims, so that a projection's
// (B, N, heads, d) output viewed as (B, heads, N, d) is read where it is (the output is written in the same order
// as q); lam expanded to (B, H, Nq), the mask (if any) as float32 with element strides.
// A call's buffers come from one block per calling thread, kept between its calls (see KeptBlock).
// A scanning call (diff_attention's eager calls) also reports whether q, k or v holds a NaN or an infinity, read as
// it reads them anyway, so that the caller needs no pass of its own over them before the call.
// A call of at most ROW_MAJOR_ROWS query rows (decoding, a draft to verify, a chunk of a prompt over a long cache, a
// short sequence) reads k where it is and takes each score as one dot product along d, VL keys at a time (their
// partial sums added up in one tree, sums); a longer call first transposes k to (d, Nk) per map, in parallel, for
// the score tiles. Transposing costs as much as one query row's scores: measured on a CPU with AVX-512 and built for
// AVX2, the row-major scores are faster up to 512 rows and within a few percent beyond (benchmarks/NOTES.md).
// Build: c++ -O3 -march=native -fopenmp -std=c++17 -shared -fPIC -pthread (no PyTorch headers; called through
// ctypes; without -fopenmp it starts threads of its own).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#include <pthread.h>  // pthread_atfork
#endif

namespace {

// The vector type and the register tiles, per target. Each tile's accumulators must stay in registers: on AVX-512
// (32 registers of 16 floats) the wide tiles; elsewhere (AVX2: 16 registers of 8 floats; NEON: 32 of 4) vectors of 8
// floats and tiles of at most 12 accumulators. A 16-float vector there is two or four registers, and the wide tiles'
// accumulators spill to the stack on every step: about ten times slower than naive. DIFFATTN_NARROW builds the
// narrow tiles on any target (the tests build both).
#if defined(__AVX512F__) && !defined(DIFFATTN_NARROW)
#define DIFFATTN_WIDE 1
constexpr int VL = 16;          // floats per vector
constexpr int SCORE_ROWS = 8;   // score tile: 8 query rows x 2 vectors of keys = 16 accumulators
constexpr int OUT_ROWS = 6;     // output tile: 6 query rows x 4 vectors of value columns = 24 accumulators
constexpr int DQ_ROWS = 12;     // dq tile: 12 query rows x 2 vectors = 24 accumulators
constexpr int KT_VECS = 2;      // dk and dv tiles: 8 keys x 2 vectors = 16 accumulators
#else
constexpr int VL = 8;
constexpr int SCORE_ROWS = 6;   // 6 x 2 = 12 accumulators
constexpr int OUT_ROWS = 3;     // 3 x 4 = 12
constexpr int DQ_ROWS = 6;      // 6 x 2 = 12
constexpr int KT_VECS = 1;      // 8 x 1 = 8
#endif
typedef float vec __attribute__((vector_size(4 * VL)));
typedef int32_t veci __attribute__((vector_size(4 * VL)));

constexpr int TILE_KEYS = 2 * VL;  // keys per score tile
constexpr int OUT_COLS = 4 * VL;   // value columns per output tile
constexpr int SCORE_COLS = 32;     // keys are padded to a multiple of this (of every tile's keys; a unit of transposing)
constexpr int KEY_CHUNK = 256;     // keys per pass of P . V (a 256 x 64 slice of V stays in L1/L2)
constexpr int ROW_MAJOR_ROWS = 512;  // calls of at most this many query rows: row-major scores (no transposed k)

inline vec splat(float x) { return vec{} + x; }
inline vec load(const float* p) { vec r; std::memcpy(&r, p, sizeof r); return r; }
inline void store(float* p, vec x) { std::memcpy(p, &x, sizeof x); }
inline float hsum(vec x) { float t = 0; for (int i = 0; i < VL; ++i) t += x[i]; return t; }
inline float hmax(vec x) { float t = x[0]; for (int i = 1; i < VL; ++i) t = x[i] > t ? x[i] : t; return t; }

// 2^x for x <= 0; x < -127 gives 0. x = n + f with n = round(x), |f| <= 1/2; 2^f by the Cephes exp2f
// polynomial (relative error ~1e-7), 2^n by writing n into the float's exponent bits.
inline vec exp2_neg(vec x) {
  x = x < -127.0f ? splat(-127.0f) : x;
  const vec round_magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vec n = (x + round_magic) - round_magic;
  const vec f = x - n;
  vec p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const veci bits = (__builtin_convertvector(n, veci) + 127) << 23;
  return p * (vec)bits;
}

// S[r][j0 : j0 + TILE_KEYS] = scale * sum_c q[r][c] * kt[c][j0 : j0 + TILE_KEYS] for SCORE_ROWS rows of q (row
// stride d).
inline void score_tile(const float* q, int d, const float* kt, int ldk, int j0, float* s, int lds, float scale) {
  vec acc[SCORE_ROWS][2] = {};
  for (int c = 0; c < d; ++c) {
    const vec k0 = load(kt + (size_t)c * ldk + j0), k1 = load(kt + (size_t)c * ldk + j0 + VL);
    for (int r = 0; r < SCORE_ROWS; ++r) {
      const vec a = splat(q[(size_t)r * d + c]);
      acc[r][0] += a * k0;
      acc[r][1] += a * k1;
    }
  }
  for (int r = 0; r < SCORE_ROWS; ++r) {
    store(s + (size_t)r * lds + j0, acc[r][0] * scale);
    store(s + (size_t)r * lds + j0 + VL, acc[r][1] * scale);
  }
}

// Lane j of sums(a): the sum of the VL lanes of a[BITREV[j]] (VL dot products' partial sums, added up in one tree
// of VL - 1 vector additions instead of VL horizontal sums). Each level adds pairs of lanes of two vectors, x's into
// the first half of each block of 2s lanes and y's into the second: lanes end in bit-reversed order, which BITREV
// undoes.
#if defined(__clang__) || __GNUC__ >= 12  // Clang's builtin, which GCC has since 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, veci{__VA_ARGS__})
#endif
#ifdef DIFFATTN_WIDE
constexpr int BITREV[VL] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
inline vec fold8(vec x, vec y) {
  return SHUFFLE(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         SHUFFLE(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline vec fold4(vec x, vec y) {
  return SHUFFLE(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         SHUFFLE(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
inline vec fold2(vec x, vec y) {
  return SHUFFLE(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         SHUFFLE(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline vec fold1(vec x, vec y) {
  return SHUFFLE(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         SHUFFLE(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
inline vec sums(const vec* a) {
  vec r[8], t[4];
  for (int i = 0; i < 8; ++i) r[i] = fold8(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; ++i) t[i] = fold4(r[2 * i], r[2 * i + 1]);
  return fold1(fold2(t[0], t[1]), fold2(t[2], t[3]));
}
#else
constexpr int BITREV[VL] = {0, 4, 2, 6, 1, 5, 3, 7};
inline vec fold4(vec x, vec y) { return SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15); }
inline vec fold2(vec x, vec y) { return SHUFFLE(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(x, y, 2, 3, 10, 11, 6, 7, 14, 15); }
inline vec fold1(vec x, vec y) { return SHUFFLE(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(x, y, 1, 9, 3, 11, 5, 13, 7, 15); }
inline vec sums(const vec* a) {
  vec r[4];
  for (int i = 0; i < 4; ++i) r[i] = fold4(a[2 * i], a[2 * i + 1]);
  return fold1(fold2(r[0], r[1]), fold2(r[2], r[3]));
}
#endif

// S[r][j] = scale * q[r] . k[j] for j in [0, nk) and `rows` rows of q, with k row-major (row stride ldk; no
// transposed copy): one dot product along d (a multiple of 32) per score; VL keys at a time,
// their partial sums added up together (sums), the keys after the last VL one by one.
inline void score_rows(const float* q, int rows, int d, const float* k, long ldk, int nk, float* s, int lds,
                       float scale) {
  const int n16 = nk / VL * VL;
  for (int j0 = 0; j0 < n16; j0 += VL)
    for (int r = 0; r < rows; ++r) {
      const float* qr = q + (size_t)r * d;
      vec acc[VL];
      for (int i = 0; i < VL; ++i) acc[i] = load(qr) * load(k + (size_t)(j0 + BITREV[i]) * ldk);
      for (int c = VL; c < d; c += VL) {
        const vec qc = load(qr + c);
        for (int i = 0; i < VL; ++i) acc[i] += qc * load(k + (size_t)(j0 + BITREV[i]) * ldk + c);
      }
      store(s + (size_t)r * lds + j0, sums(acc) * splat(scale));
    }
  for (int j = n16; j < nk; ++j) {
    const float* kr = k + (size_t)j * ldk;
    for (int r = 0; r < rows; ++r) {
      const float* qr = q + (size_t)r * d;
      vec acc = load(qr) * load(kr);
      for (int c = VL; c < d; c += VL) acc += load(qr + c) * load(kr + c);
      s[(size_t)r * lds + j] = hsum(acc) * scale;
    }
  }
}

// O[r][c0 : c0 + OUT_COLS] (+)= sum_{j0 <= j < j1} P[r][j] * V[j][c0 : c0 + OUT_COLS] for R rows (OUT_ROWS, or
// fewer at the end of a block).
template <int R = OUT_ROWS>
inline void out_tile(const float* p, int ldp, int j0, int j1, const float* v, long ldv, int c0, float* o, long ldo,
                     bool first) {
  vec acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < 4; ++x) acc[r][x] = first ? vec{} : load(o + r * ldo + c0 + VL * x);
  for (int j = j0; j < j1; ++j) {
    const float* vr = v + (size_t)j * ldv + c0;
    const vec v0 = load(vr), v1 = load(vr + VL), v2 = load(vr + 2 * VL), v3 = load(vr + 3 * VL);
    for (int r = 0; r < R; ++r) {
      const vec a = splat(p[(size_t)r * ldp + j]);
      acc[r][0] += a * v0;
      acc[r][1] += a * v1;
      acc[r][2] += a * v2;
      acc[r][3] += a * v3;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < 4; ++x) store(o + r * ldo + c0 + VL * x, acc[r][x]);
}

// out_tile for the last n < OUT_ROWS rows.
inline void out_tail(int n, const float* p, int ldp, int j0, int j1, const float* v, long ldv, int c0, float* o,
                     long ldo, bool first) {
  switch (n) {
    case 1: return out_tile<1>(p, ldp, j0, j1, v, ldv, c0, o, ldo, first);
    case 2: return out_tile<2>(p, ldp, j0, j1, v, ldv, c0, o, ldo, first);
    case 3: return out_tile<3>(p, ldp, j0, j1, v, ldv, c0, o, ldo, first);
    case 4: return out_tile<4>(p, ldp, j0, j1, v, ldv, c0, o, ldo, first);
    default: return out_tile<5>(p, ldp, j0, j1, v, ldv, c0, o, ldo, first);
  }
}

// One row of scores: add the mask row (key stride 0 or 1), replace s[j] by exp2((s[j] - max) * exp_scale)
// (exp_scale = LOG2E: e^(s[j] - max)) for the nvis visible keys and by 0 up to npad. Returns the row sum;
// 0 when every visible score is -inf (the caller then writes a zero row); NaN, with the row NaN, when no score is
// above -inf but one is NaN (a mask row of NaN: the max skips NaN, and the row must not pass for fully masked).
inline float softmax_numerators(float* s, int nvis, int npad, const float* mask, long mask_key_stride,
                                float exp_scale, float* row_max = nullptr) {
  const int nv = nvis / VL * VL;
  if (mask && mask_key_stride == 1) {
    for (int j = 0; j < nv; j += VL) store(s + j, load(s + j) + load(mask + j));
    for (int j = nv; j < nvis; ++j) s[j] += mask[j];
  } else if (mask) {
    for (int j = 0; j < nvis; ++j) s[j] += mask[0];
  }
  vec mv = splat(-INFINITY);
  for (int j = 0; j < nv; j += VL) { const vec x = load(s + j); mv = x > mv ? x : mv; }
  float m = hmax(mv);
  for (int j = nv; j < nvis; ++j) m = s[j] > m ? s[j] : m;
  if (row_max) *row_max = m;
  if (m == -INFINITY) {
    for (int j = 0; j < nvis; ++j)
      if (std::isnan(s[j])) {
        for (int i = 0; i < npad; ++i) s[i] = NAN;
        return NAN;
      }
    return 0.0f;
  }
  mv = splat(m);
  const vec es = splat(exp_scale);
  vec sum = {};
  for (int j = 0; j < nv; j += VL) { const vec e = exp2_neg((load(s + j) - mv) * es); store(s + j, e); sum += e; }
  float total = hsum(sum);
  for (int j = nv; j < nvis; ++j) { s[j] = std::exp2((s[j] - m) * exp_scale); total += s[j]; }
  for (int j = nvis; j < npad; ++j) s[j] = 0.0f;
  return total;
}

// A call's buffers (k transposed, per-thread score blocks, ...) are carved from one block per calling thread,
// kept for that thread's next call: freeing them returns their pages to the system, and faulting megabytes of fresh
// pages in on every call, in this call and in torch's next allocations, cost more than the work at short
// sequences. A block above keep_floats is freed after its call (diff_attention_cpu_release frees any now).
std::atomic<size_t> keep_floats{(size_t)64 << 18};  // 64 MiB (diff_attention_cpu_keep_at_most)

struct KeptBlock {
  std::unique_ptr<float[]> data;
  size_t size = 0;
};
thread_local KeptBlock kept;

// Hands out 64-byte aligned pieces of a block: first with base null, to add up the sizes, then of the block.
struct Carver {
  float* base = nullptr;
  size_t used = 0;
  float* take(size_t n) {
    float* at = base ? base + used : nullptr;
    used += (n + VL - 1) / VL * VL;
    return at;
  }
};

// The calling thread's block, at least n floats (throws std::bad_alloc).
float* work_block(size_t n) {
  if (kept.size < n) {
    kept.data.reset();
    kept.size = 0;
    kept.data.reset(new float[n + 16]);  // + 16: room to align the start to 64 bytes
    kept.size = n;
  }
  auto at = reinterpret_cast<std::uintptr_t>(kept.data.get());
  return reinterpret_cast<float*>((at + 63) / 64 * 64);
}

void release_large_block() {
  if (kept.size > keep_floats) {
    kept.data.reset();
    kept.size = 0;
  }
}

// Where a tensor's rows are: element strides of its batch, head (map) and row dims; its last dim is contiguous.
// Views of a projection's (B, N, heads, d) output, transposed to (B, heads, N, d), are read where they are.
struct Layout {
  long b, h, r;
  template <class T>
  T* at(T* base, long batch, long head, long row = 0) const { return base + batch * b + head * h + row * r; }
};

// Rows [r0, r0 + rows) of width w at src (row stride ld) where they can be read as a block of `full` rows of stride
// w: src itself, or a zero-padded copy in buf.
const float* block_rows_at(const float* src, long ld, int rows, int full, int w, float* buf) {
  if (rows == full && ld == w) return src;
  for (int r = 0; r < full; ++r)
    if (r < rows) std::copy(src + r * ld, src + r * ld + w, buf + (size_t)r * w);
    else std::fill(buf + (size_t)r * w, buf + (size_t)(r + 1) * w, 0.0f);
  return buf;
}

// The call's boundary: what boundary.py passes, by field (its ctypes Structures of the same names mirror these;
// diff_attention_cpu_fields lists their offsets for the check). Plain C layout: pointers, longs, ints, floats.

// One problem, as the forward and the backward read it. q (B, 2H, nq, d), k (B, 2Hkv, nk, d), v (B, Hkv, nk, dv)
// float32 with contiguous rows where their layouts put them; lam (B, H, nq) contiguous float32; mask null or
// float32 with element strides mask_b..mask_k of its (B, H, nq, nk) view (0 where broadcast, 1 or 0 along keys).
struct Inputs {
  const float *q, *k, *v, *lam, *mask;
  Layout lq, lk, lv;
  long mask_b, mask_h, mask_q, mask_k;
  int batch, heads, kv_heads, nq, nk, d, dv, block_rows;
  int causal;     // bottom-right aligned: row i sees keys j <= i + nk - nq
  int n_threads;  // at most this many threads
  float qk_scale;   // the softmax scale: scores in natural units, as naive's
  float exp_scale;  // LOG2E: exp2((s - max) * exp_scale) = e^(s - max)
};

// The forward's own: out (B, H, nq, dv) float32 where lo puts it (rows not overlapping). maps: null, or
// (B, H, 2, nq, nk_pad) float32 where to keep each row's two normalised maps, P1 / l1 and P2 / l2, for
// diff_attention_cpu_backward (written up to the keys the row's block reads; zero rows where fully masked). scan:
// also write to nonfinite whether q, k or v holds a NaN or an infinity (then out is not to be used): the kernel scans
// them as it reads them, k and v while it transposes k, q block by block.
struct ForwardArgs {
  float* out;
  float* maps;
  Layout lo;
  int scan;
  int nonfinite;
};

struct Problem : Inputs, ForwardArgs {
  float* kt = nullptr;  // k transposed per map, (B, 2Hkv, d, nk_pad), zero beyond nk (null: row-major scores)
  int nk_pad = 0;
};

// Per-thread buffers: two block_rows x nk_pad score blocks; the queries of a block whose rows are strided or, in the
// last, partial block, zero-padded; that block's output rows.
struct Scratch {
  float *s1, *s2, *q1, *q2, *out;
  Scratch(const Problem& P, Carver& c)
      : s1(c.take((size_t)P.block_rows * P.nk_pad)), s2(c.take((size_t)P.block_rows * P.nk_pad)),
        q1(c.take((size_t)P.block_rows * P.d)), q2(c.take((size_t)P.block_rows * P.d)),
        out(c.take((size_t)P.block_rows * P.dv)) {}
};

// dst (w, n_pad) = src (n rows of stride ld, width w) transposed for rows [j0, j0 + 32), zero beyond n.
void transpose_rows(const float* src, long ld, int n, int w, float* dst, int n_pad, int j0) {
  for (int c = 0; c < w; ++c)
    for (int j = j0; j < j0 + SCORE_COLS; ++j) dst[(size_t)c * n_pad + j] = j < n ? src[j * ld + c] : 0.0f;
}

// Work item of the first phase: keys [j0, j0 + 32) of key map m (of B * 2Hkv) into kt, transposed.
void transpose_keys(const Problem& P, long m, int j0) {
  const long maps = 2L * P.kv_heads;
  transpose_rows(P.lk.at(P.k, m / maps, m % maps), P.lk.r, P.nk, P.d, P.kt + (size_t)m * P.d * P.nk_pad, P.nk_pad, j0);
}

// Whether `rows` rows of width w (a multiple of 16; row stride ld) at src are all finite: x - x is 0 for a finite
// x and NaN for an infinity or a NaN, and one NaN makes the sum NaN (no -ffast-math: the compiler keeps x - x).
bool finite_rows(const float* src, long ld, int rows, int w) {
  vec acc = {};
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < w; c += VL) {
      const vec x = load(src + r * ld + c);
      acc += x - x;
    }
  for (int i = 0; i < VL; ++i)
    if (acc[i] != acc[i]) return false;
  return true;
}

// Whether keys [j0, j1) of key map m (of B * 2Hkv) are finite in k, and, for the first map of a pair, in v.
bool finite_keys(const Problem& P, long m, int j0, int j1) {
  const long maps = 2L * P.kv_heads, b = m / maps, km = m % maps;
  if (j1 <= j0) return true;
  if (!finite_rows(P.lk.at(P.k, b, km, j0), P.lk.r, j1 - j0, P.d)) return false;
  return km % 2 || finite_rows(P.lv.at(P.v, b, km / 2, j0), P.lv.r, j1 - j0, P.dv);
}

// Work item of the second phase: rows [r0, r0 + block_rows) of head h in batch b. With `seen` (a scanning call),
// a NaN or an infinity in the rows of q sets it.
void block(const Problem& P, int b, int h, int r0, Scratch& w, std::atomic<bool>* seen) {
  const int g = h / (P.heads / P.kv_heads), BQ = P.block_rows, rows = std::min(BQ, P.nq - r0);
  // the rows as a dense block (copied where strided, and in the last block zero-padded)
  const float* q1 = block_rows_at(P.lq.at(P.q, b, 2 * h, r0), P.lq.r, rows, BQ, P.d, w.q1);
  const float* q2 = block_rows_at(P.lq.at(P.q, b, 2 * h + 1, r0), P.lq.r, rows, BQ, P.d, w.q2);
  if (seen && !(finite_rows(q1, P.d, rows, P.d) && finite_rows(q2, P.d, rows, P.d)))
    seen->store(true, std::memory_order_relaxed);
  float *s1 = w.s1, *s2 = w.s2;
  const bool row_major = P.kt == nullptr;  // at most ROW_MAJOR_ROWS rows: k read where it is
  const float* k1 = row_major ? P.lk.at(P.k, b, 2 * g) : P.kt + ((size_t)b * 2 * P.kv_heads + 2 * g) * P.d * P.nk_pad;
  const float* k2 = row_major ? P.lk.at(P.k, b, 2 * g + 1) : k1 + (size_t)P.d * P.nk_pad;
  const float* vg = P.lv.at(P.v, b, g);
  const float* lam = P.lam + ((size_t)b * P.heads + h) * P.nq + r0;
  float* o_rows = P.lo.at(P.out, b, h, r0);
  const bool direct = rows == BQ;  // the last, partial block: through a buffer, its rows copied out
  float* o = direct ? o_rows : w.out;
  const long ldo = direct ? P.lo.r : P.dv;
  const int shift = P.nk - P.nq;  // causal: row i sees keys j < i + 1 + shift
  const int kmax = P.causal ? std::clamp(r0 + BQ + shift, 0, P.nk) : P.nk;
  const int kpad = (kmax + SCORE_COLS - 1) / SCORE_COLS * SCORE_COLS;
  // rows computed: the rows there are, in the tiled path up to a whole score tile (padding rows of q are zero)
  const int used = row_major ? rows : (rows + SCORE_ROWS - 1) / SCORE_ROWS * SCORE_ROWS;
  if (row_major) {
    score_rows(q1, rows, P.d, k1, P.lk.r, kmax, s1, P.nk_pad, P.qk_scale);
    score_rows(q2, rows, P.d, k2, P.lk.r, kmax, s2, P.nk_pad, P.qk_scale);
  } else {
    for (int j0 = 0; j0 < kpad; j0 += TILE_KEYS)
      for (int r = 0; r < used; r += SCORE_ROWS) {
        score_tile(q1 + (size_t)r * P.d, P.d, k1, P.nk_pad, j0, s1 + (size_t)r * P.nk_pad, P.nk_pad, P.qk_scale);
        score_tile(q2 + (size_t)r * P.d, P.d, k2, P.nk_pad, j0, s2 + (size_t)r * P.nk_pad, P.nk_pad, P.qk_scale);
      }
  }
  for (int r = 0; r < used; ++r) {
    const int row = r0 + r;
    const int nvis = P.causal ? std::clamp(row + 1 + shift, 0, kmax) : kmax;
    const float* mrow = P.mask && row < P.nq ? P.mask + b * P.mask_b + h * P.mask_h + row * P.mask_q : nullptr;
    float* p1 = s1 + (size_t)r * P.nk_pad;
    float* p2 = s2 + (size_t)r * P.nk_pad;
    const float l1 = softmax_numerators(p1, nvis, kpad, mrow, P.mask_k, P.exp_scale);
    const float l2 = softmax_numerators(p2, nvis, kpad, mrow, P.mask_k, P.exp_scale);
    float* m1 = P.maps && row < P.nq ? P.maps + (((size_t)b * P.heads + h) * 2 * P.nq + row) * P.nk_pad : nullptr;
    float* m2 = m1 ? m1 + (size_t)P.nq * P.nk_pad : nullptr;
    if (l1 == 0.0f || l2 == 0.0f) {
      std::memset(p1, 0, sizeof(float) * kpad);
      if (m1) std::memset(m1, 0, sizeof(float) * kpad), std::memset(m2, 0, sizeof(float) * kpad);
      continue;
    }
    const vec a1 = splat(1.0f / l1), a2 = splat((row < P.nq ? lam[r] : 0.0f) / l2);
    if (m1) {  // kept: P1 / l1 and P2 / l2, the row's keys up to kpad (0 beyond the keys it sees)
      const vec i2 = splat(1.0f / l2);
      for (int j = 0; j < kpad; j += VL) store(m1 + j, load(p1 + j) * a1), store(m2 + j, load(p2 + j) * i2);
    }  // a loop of its own: the one below compiles as without kept maps (the same fused multiply-adds, the same bits)
    for (int j = 0; j < kpad; j += VL) store(p1 + j, load(p1 + j) * a1 - load(p2 + j) * a2);
  }
  for (int j0 = 0; j0 < std::max(kpad, 1); j0 += KEY_CHUNK)
    for (int c0 = 0; c0 < P.dv; c0 += OUT_COLS)
      for (int r = 0; r < used; r += OUT_ROWS) {
        const int j1 = std::min({kpad, P.nk, j0 + KEY_CHUNK});  // P is 0 beyond nk: V's rows there are never read
        if (used - r >= OUT_ROWS)
          out_tile(s1 + (size_t)r * P.nk_pad, P.nk_pad, j0, j1, vg, P.lv.r, c0, o + r * ldo, ldo, j0 == 0);
        else
          out_tail(used - r, s1 + (size_t)r * P.nk_pad, P.nk_pad, j0, j1, vg, P.lv.r, c0, o + r * ldo, ldo, j0 == 0);
      }
  for (int r = 0; !direct && r < rows; ++r) std::copy(o + (size_t)r * P.dv, o + (size_t)(r + 1) * P.dv, o_rows + r * P.lo.r);
}

// How the last call of run_items ran its items (diff_attention_cpu_last_threads): for the tests.
enum Path { INLINE = 0, OPENMP = 1, OWN = 2 };
std::atomic<int> last_path{INLINE};

#ifdef _OPENMP
std::atomic<bool> use_openmp{false};  // diff_attention_cpu_use_openmp: the caller's choice (at load; tests switch it)
std::atomic<bool> forked{false};      // set in a child forked from this process, for good: GNU OpenMP's pool does
                                      // not survive fork (a parallel region there waits forever for its threads)
void note_fork() { forked = true; }
const int fork_handler = pthread_atfork(nullptr, nullptr, note_fork);  // registered when the library is loaded
#endif

// Runs item(t, i) for i in [0, items) on n_workers threads (t: the thread's index), handing items out through
// one atomic counter: in an OpenMP parallel region where use_openmp is set (a team smaller than asked for just
// takes more items each), else on threads started here (one that cannot be started leaves its share to the others).
template <class Item>
void run_items(long items, int n_workers, Item item) {
  std::atomic<long> next{0};
  auto worker = [&](int t) {
    for (long i; (i = next.fetch_add(1)) < items;) item(t, i);
  };
  if (n_workers <= 1 || items <= 1) {
    last_path = INLINE;
    return worker(0);
  }
#ifdef _OPENMP
  if (use_openmp && !forked) {
    last_path = OPENMP;
#pragma omp parallel num_threads(n_workers)
    worker(omp_get_thread_num());
    return;
  }
#endif
  last_path = OWN;
  std::vector<std::thread> threads;
  for (int t = 1; t < n_workers; ++t) {
    try {
      threads.emplace_back(worker, t);
    } catch (const std::system_error&) {
      break;
    }
  }
  worker(0);
  for (auto& t : threads) t.join();
}

// ------------------------------------------------------------------------------------------------------------
// Backward. With A_m = softmax(S_m) (S_m = q_m . k_m^T s + mask), D = A1 - lam A2 and O = D V, given dO:
//   dV = D^T dO,   dP = dO V^T,   delta_m = rowsum(A_m * dP),   dlam = -delta_2,
//   dS1 = A1 * (dP - delta_1),   dS2 = -lam A2 * (dP - delta_2),   dq_m = dS_m k_m s,   dk_m = dS_m^T q_m s.
// One pass over blocks of query rows, as the forward's: a block's scores and dP over every key its rows see (in
// L2), their softmax, the deltas, then dS1, dS2 and D in place, and five products: dq_m = dS_m k_m (written),
// and dk_m += dS_m^T q_m, dV += D^T dO into partial sums over all keys. Ten map-sized products in all, the
// convention's count (a pass per key block would recompute the scores and dP: fourteen). A work item is one
// group of row blocks of one head (blocks g, g + G, g + 2G, ...: causal rows of every length in each group)
// with partial sums of its own; a second step adds every head's and group's partial sums for a block of keys,
// in a fixed order. G depends on the shapes only (enough items for a few threads), so the gradients do not
// depend on the thread count. The partial sums (G x B x H x nk x (2d + dv) floats) replace an N x N tensor.
// ------------------------------------------------------------------------------------------------------------

constexpr int MIN_ITEMS = 8;  // row groups per head: enough that B x H x G items keep a few threads busy

// O[r][c0 : c0 + VL NV] (+)= sum_{j0 <= j < j1} P[r][j] * X[j][c0 : c0 + VL NV] for ROWS rows (row strides
// ldp, ldx, ldo).
template <int ROWS, int NV>
inline void mul_tile(const float* p, int ldp, int j0, int j1, const float* x, long ldx, int c0, float* o, long ldo,
                     bool first) {
  vec acc[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int u = 0; u < NV; ++u) acc[r][u] = first ? vec{} : load(o + r * ldo + c0 + VL * u);
  for (int j = j0; j < j1; ++j) {
    vec xv[NV];
    for (int u = 0; u < NV; ++u) xv[u] = load(x + j * ldx + c0 + VL * u);
    for (int r = 0; r < ROWS; ++r) {
      const vec a = splat(p[(size_t)r * ldp + j]);
      for (int u = 0; u < NV; ++u) acc[r][u] += a * xv[u];
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int u = 0; u < NV; ++u) store(o + r * ldo + c0 + VL * u, acc[r][u]);
}

// rows x (width, multiple of VL NV; row stride ldo) (+)= P (rows x [j0, j1)) . X in tiles of ROWS rows and VL NV
// columns (dq: DQ_ROWS x 2 vectors).
template <int ROWS, int NV>
inline void mul_rows(const float* p, int ldp, int rows, int j0, int j1, const float* x, long ldx, int width, float* o,
                     long ldo, bool first) {
  for (int r = 0; r < rows; r += ROWS)
    for (int c0 = 0; c0 < width; c0 += VL * NV)
      mul_tile<ROWS, NV>(p + (size_t)r * ldp, ldp, j0, j1, x, ldx, c0, o + r * ldo, ldo, first);
}

// O[r][c0 : c0 + 32] += sum_{j < nj} P[j][r] * X[j][c0 : c0 + 32] for 8 rows r (keys) of P^T: P row-major
// (query rows j, keys r, row stride ldp), X (nj, ldx).
inline void mul_tile_t(const float* p, int ldp, int nj, const float* x, int ldx, int c0, float* o, int ldo,
                       bool first) {
  vec acc[8][KT_VECS];
  for (int r = 0; r < 8; ++r)
    for (int u = 0; u < KT_VECS; ++u) acc[r][u] = first ? vec{} : load(o + (size_t)r * ldo + c0 + VL * u);
  for (int j = 0; j < nj; ++j) {
    vec xv[KT_VECS];
    for (int u = 0; u < KT_VECS; ++u) xv[u] = load(x + (size_t)j * ldx + c0 + VL * u);
    const float* pj = p + (size_t)j * ldp;
    for (int r = 0; r < 8; ++r) {
      const vec a = splat(pj[r]);
      for (int u = 0; u < KT_VECS; ++u) acc[r][u] += a * xv[u];
    }
  }
  for (int r = 0; r < 8; ++r)
    for (int u = 0; u < KT_VECS; ++u) store(o + (size_t)r * ldo + c0 + VL * u, acc[r][u]);
}

// keys x (width, multiple of 32) += P^T . X, P (nj x keys, row stride ldp), X (nj x width): dk_m and dv. Rows from
// `fresh` on are written, not added to (no earlier block of rows has reached those keys).
inline void mul_rows_t(const float* p, int ldp, int keys, int nj, const float* x, int width, float* o, int fresh) {
  for (int r = 0; r < keys; r += 8)
    for (int c0 = 0; c0 < width; c0 += KT_VECS * VL)
      mul_tile_t(p + r, ldp, nj, x, width, c0, o + (size_t)r * width, width, r >= fresh);
}

// The backward's own: dout (B, H, nq, dv) float32 where ldo puts it; maps null (recompute them) or the forward's
// kept maps; the gradients gq, gk, gv shaped as q, k, v (float32, contiguous rows, where lgq, lgk, lgv put them,
// written in full, not overlapping) and glam (B, H, nq) contiguous float32.
struct BackwardArgs {
  const float* dout;
  const float* maps;
  float *gq, *gk, *gv, *glam;
  Layout ldo, lgq, lgk, lgv;
};

struct Grad : Inputs, BackwardArgs {
  float *kt = nullptr, *vt = nullptr;  // transposed: (.., d or dv, nk_pad)
  float* part = nullptr;               // partial sums, per item: dk1, dk2 (nk_pad, d) and dv (nk_pad, dv)
  int nk_pad = 0, groups = 1;
  size_t part_size() const { return (size_t)nk_pad * (2 * d + dv); }
};

struct GradScratch {
  float *s1, *s2, *dp, *q1, *q2, *dout, *dq1, *dq2;
  GradScratch(const Grad& G, Carver& c) {
    const size_t BQ = G.block_rows;
    s1 = c.take(BQ * G.nk_pad); s2 = c.take(BQ * G.nk_pad); dp = c.take(BQ * G.nk_pad);
    q1 = c.take(BQ * G.d); q2 = c.take(BQ * G.d); dout = c.take(BQ * G.dv); dq1 = c.take(BQ * G.d);
    dq2 = c.take(BQ * G.d);
  }
};

// The block dout (BQ x dv, dense: the caller's gradient itself or buf) with row r zero, through buf: a fully masked
// row's dP is zero, and its dout (which may hold a NaN: the row's output is a constant 0) must not reach dv as 0 * NaN.
inline const float* zero_row(const float* dout, int r, int BQ, int dv, float* buf) {
  if (dout != buf) std::copy(dout, dout + (size_t)BQ * dv, buf);
  std::fill(buf + (size_t)r * dv, buf + (size_t)(r + 1) * dv, 0.0f);
  return buf;
}

// Rows [r0, r0 + block_rows) of head h in batch b: dq and dlam written, dk and dv added to the item's partial sums.
void grad_rows(const Grad& G, int b, int h, int r0, GradScratch& w, float* part, int& written) {
  const int g = h / (G.heads / G.kv_heads), BQ = G.block_rows, rows = std::min(BQ, G.nq - r0);
  const float* q1 = block_rows_at(G.lq.at(G.q, b, 2 * h, r0), G.lq.r, rows, BQ, G.d, w.q1);
  const float* q2 = block_rows_at(G.lq.at(G.q, b, 2 * h + 1, r0), G.lq.r, rows, BQ, G.d, w.q2);
  const float* dout = block_rows_at(G.ldo.at(G.dout, b, h, r0), G.ldo.r, rows, BQ, G.dv, w.dout);
  const size_t kmap = (size_t)b * 2 * G.kv_heads + 2 * g;
  const float* k1t = G.kt + kmap * G.d * G.nk_pad;
  const float* k2t = k1t + (size_t)G.d * G.nk_pad;
  const float* vt = G.vt + ((size_t)b * G.kv_heads + g) * G.dv * G.nk_pad;
  const float* k1 = G.lk.at(G.k, b, 2 * g);
  const float* k2 = G.lk.at(G.k, b, 2 * g + 1);
  const float* lam = G.lam + ((size_t)b * G.heads + h) * G.nq + r0;
  float* dlam = G.glam + ((size_t)b * G.heads + h) * G.nq + r0;
  float *s1 = w.s1, *s2 = w.s2, *dp = w.dp;
  const int ld = G.nk_pad, shift = G.nk - G.nq;
  const int kmax = G.causal ? std::clamp(r0 + BQ + shift, 0, G.nk) : G.nk;
  const int kpad = (kmax + SCORE_COLS - 1) / SCORE_COLS * SCORE_COLS;
  for (int j0 = 0; j0 < kpad; j0 += TILE_KEYS)
    for (int r = 0; r < BQ; r += SCORE_ROWS) {
      if (!G.maps) {
        score_tile(q1 + (size_t)r * G.d, G.d, k1t, ld, j0, s1 + (size_t)r * ld, ld, G.qk_scale);
        score_tile(q2 + (size_t)r * G.d, G.d, k2t, ld, j0, s2 + (size_t)r * ld, ld, G.qk_scale);
      }
      score_tile(dout + (size_t)r * G.dv, G.dv, vt, ld, j0, dp + (size_t)r * ld, ld, 1.0f);
    }
  for (int r = 0; r < BQ; ++r) {  // row r: p1, p2 := dS1 s, dS2 s and dpr := D, in place
    const int row = r0 + r;
    float *p1 = s1 + (size_t)r * ld, *p2 = s2 + (size_t)r * ld, *dpr = dp + (size_t)r * ld;
    const int nvis = G.causal ? std::clamp(row + 1 + shift, 0, kmax) : kmax;
    const float* mrow = G.mask && row < G.nq ? G.mask + b * G.mask_b + h * G.mask_h + row * G.mask_q : nullptr;
    float l1, l2;
    if (G.maps) {  // the forward's P1 / l1 and P2 / l2 (a fully masked row: zeros, so zero gradients)
      l1 = l2 = row < G.nq ? 1.0f : 0.0f;
      if (row < G.nq) {
        const float* m1 = G.maps + (((size_t)b * G.heads + h) * 2 * G.nq + row) * G.nk_pad;
        const float* m2 = m1 + (size_t)G.nq * G.nk_pad;
        std::copy(m1, m1 + nvis, p1);
        std::copy(m2, m2 + nvis, p2);
        std::fill(p1 + nvis, p1 + kpad, 0.0f);
        std::fill(p2 + nvis, p2 + kpad, 0.0f);
        // kept as zeros (a live row's largest entry is 1 / l > 0): fully masked, handled as where recomputed, so that
        // a NaN or an infinity in dP (dout . v) does not reach dq, dk and dlam through 0 * NaN
        if (std::all_of(p1, p1 + nvis, [](float x) { return x == 0.0f; })) l1 = l2 = 0.0f;
      }
    } else {
      l1 = row < G.nq ? softmax_numerators(p1, nvis, kpad, mrow, G.mask_k, G.exp_scale) : 0.0f;
      l2 = row < G.nq ? softmax_numerators(p2, nvis, kpad, mrow, G.mask_k, G.exp_scale) : 0.0f;
    }
    if (l1 == 0.0f || l2 == 0.0f) {  // a fully masked row (or padding): no softmax, zero gradients
      std::memset(p1, 0, sizeof(float) * kpad);
      std::memset(p2, 0, sizeof(float) * kpad);
      std::memset(dpr, 0, sizeof(float) * kpad);
      if (row < G.nq) {
        dlam[r] = 0.0f;
        dout = zero_row(dout, r, BQ, G.dv, w.dout);
      }
      continue;
    }
    const float il1 = 1.0f / l1, il2 = 1.0f / l2, lr = lam[r];
    const int nv = nvis / VL * VL;
    vec d1 = {}, d2 = {};
    for (int j = 0; j < nv; j += VL) {
      const vec x = load(dpr + j);
      d1 += load(p1 + j) * x;
      d2 += load(p2 + j) * x;
    }
    float delta1 = hsum(d1), delta2 = hsum(d2);
    for (int j = nv; j < nvis; ++j) { delta1 += p1[j] * dpr[j]; delta2 += p2[j] * dpr[j]; }
    delta1 *= il1;
    delta2 *= il2;
    const vec a1 = splat(il1 * G.qk_scale), a2 = splat(-lr * il2 * G.qk_scale), e1 = splat(delta1), e2 = splat(delta2);
    const vec i1 = splat(il1), i2 = splat(lr * il2);
    for (int j = 0; j < kpad; j += VL) {
      const vec x = load(dpr + j), y1 = load(p1 + j), y2 = load(p2 + j);
      store(dpr + j, y1 * i1 - y2 * i2);
      store(p1 + j, y1 * a1 * (x - e1));
      store(p2 + j, y2 * a2 * (x - e2));
    }
    dlam[r] = 0.0f - delta2;  // +0 for a fully masked row's kept zeros
  }
  float* gq1 = G.lgq.at(G.gq, b, 2 * h, r0);
  float* gq2 = G.lgq.at(G.gq, b, 2 * h + 1, r0);
  const bool direct = rows == BQ;  // the last, partial block: through buffers, its rows copied out
  const long ldq = direct ? G.lgq.r : G.d;
  float* dq1 = direct ? gq1 : w.dq1;
  float* dq2 = direct ? gq2 : w.dq2;
  for (int j0 = 0; j0 < std::max(kpad, 1); j0 += KEY_CHUNK) {
    const int j1 = std::min({kpad, G.nk, j0 + KEY_CHUNK});  // dS is 0 beyond nk: k's rows there are never read
    mul_rows<DQ_ROWS, 2>(s1, ld, BQ, j0, j1, k1, G.lk.r, G.d, dq1, ldq, j0 == 0);
    mul_rows<DQ_ROWS, 2>(s2, ld, BQ, j0, j1, k2, G.lk.r, G.d, dq2, ldq, j0 == 0);
  }
  for (int r = 0; !direct && r < rows; ++r) {
    std::copy(dq1 + (size_t)r * G.d, dq1 + (size_t)(r + 1) * G.d, gq1 + r * G.lgq.r);
    std::copy(dq2 + (size_t)r * G.d, dq2 + (size_t)(r + 1) * G.d, gq2 + r * G.lgq.r);
  }
  float* pk1 = part;  // dS and D are 0 beyond the keys the rows see: only keys [0, kpad) change
  float* pk2 = pk1 + (size_t)G.nk_pad * G.d;
  float* pv = pk2 + (size_t)G.nk_pad * G.d;
  mul_rows_t(s1, ld, kpad, rows, q1, G.d, pk1, written);
  mul_rows_t(s2, ld, kpad, rows, q2, G.d, pk2, written);
  mul_rows_t(dp, ld, kpad, rows, dout, G.dv, pv, written);
  written = std::max(written, kpad);
}

// Work item of the first step: row blocks y, y + G, y + 2G, ... of head h in batch b, into its partial sums.
void grad_group(const Grad& G, int b, int h, int y, GradScratch& w) {
  float* part = G.part + (((size_t)b * G.heads + h) * G.groups + y) * G.part_size();
  int written = 0;  // key rows of the partial sums written so far (the first block to reach a key writes it)
  for (int r0 = y * G.block_rows; r0 < G.nq; r0 += G.groups * G.block_rows) grad_rows(G, b, h, r0, w, part, written);
  const size_t widths[3] = {(size_t)G.d, (size_t)G.d, (size_t)G.dv};
  for (const size_t wd : widths) {  // keys no row of the group sees (causal, or no rows): zero
    std::fill(part + written * wd, part + G.nk_pad * wd, 0.0f);
    part += G.nk_pad * wd;
  }
}

// Work item of the second step: keys [j0, j0 + 32) of KV head g in batch b: dk1, dk2 and dv are the sums of the
// partial sums of every head of the group and every row group, in that order.
void sum_keys(const Grad& G, int b, int g, int j0) {
  const int rep = G.heads / G.kv_heads, j1 = std::min(j0 + SCORE_COLS, G.nk);
  float* outs[3] = {G.lgk.at(G.gk, b, 2 * g), G.lgk.at(G.gk, b, 2 * g + 1), G.lgv.at(G.gv, b, g)};
  const long strides[3] = {G.lgk.r, G.lgk.r, G.lgv.r};
  const size_t offsets[3] = {0, (size_t)G.nk_pad * G.d, (size_t)2 * G.nk_pad * G.d};
  const int widths[3] = {G.d, G.d, G.dv};
  const float* first = G.part + ((size_t)b * G.heads + (size_t)g * rep) * G.groups * G.part_size();
  const int parts = rep * G.groups;  // consecutive: heads g * rep ... of batch b, each with its G groups
  for (int a = 0; a < 3; ++a)
    for (int j = j0; j < j1; ++j)
      for (int c = 0; c < widths[a]; c += VL) {
        const size_t at = offsets[a] + (size_t)j * widths[a] + c;
        vec acc = load(first + at);
        for (int x = 1; x < parts; ++x) acc += load(first + (size_t)x * G.part_size() + at);
        store(outs[a] + j * strides[a] + c, acc);
      }
}

}  // namespace

// Whether the kernel runs on OpenMP's thread pool (use != 0) or on threads of its own; returns whether it can, that
// is, whether it was built with OpenMP and this process is not a child forked after the library was loaded (there it
// always starts threads of its own). The caller decides at load: OpenMP only where the process has one OpenMP
// runtime, so that the pool is torch's (cpu_fused.py).
extern "C" int diff_attention_cpu_use_openmp(int use) {
#ifdef _OPENMP
  use_openmp = use != 0 && fork_handler == 0;
  return (fork_handler == 0 && !forked) ? 1 : 0;
#else
  (void)use;
  return 0;
#endif
}

// Whether the kernel's calls now run on OpenMP's thread pool (chosen, and not in a child forked since).
extern "C" int diff_attention_cpu_on_openmp() {
#ifdef _OPENMP
  return use_openmp && !forked ? 1 : 0;
#else
  return 0;
#endif
}

// Floats per vector of this build: 16 where it was built for AVX-512, else 8 (the tiles above).
extern "C" int diff_attention_cpu_vector_floats() { return VL; }

// How the last step of the last call ran its work items: 0 on the calling thread alone (one thread, or one item),
// 1 on OpenMP's pool, 2 on threads it started.
extern "C" int diff_attention_cpu_last_threads() { return last_path; }

// The forward of the problem `in` (see Inputs and ForwardArgs). Returns 0; -1 for sizes it cannot take; -2 when out
// of memory.
extern "C" int diff_attention_cpu_forward(const Inputs* in, ForwardArgs* args) {
  Problem P{*in, *args};
  P.nk_pad = (P.nk + SCORE_COLS - 1) / SCORE_COLS * SCORE_COLS;
  const int BQ = P.block_rows;
  if (BQ <= 0 || BQ % SCORE_ROWS || BQ % OUT_ROWS || P.dv % OUT_COLS || P.d <= 0 || P.nq < 0 || P.nk < 0 ||
      P.kv_heads <= 0 || P.heads % P.kv_heads)
    return -1;
  const long key_maps = (long)P.batch * 2 * P.kv_heads, key_tiles = P.nk_pad / SCORE_COLS;
  const long blocks = (P.nq + BQ - 1) / BQ, items = (long)P.batch * P.heads * blocks;
  const int n_workers = (int)std::max(1L, std::min<long>(P.n_threads, std::max(items, key_maps * key_tiles)));
  const bool row_major = P.nq <= ROW_MAJOR_ROWS;
  std::vector<Scratch> scratch;
  Carver c;
  for (int pass = 0; pass < 2; ++pass) {  // sizes, then pieces of the block
    c.used = 0;
    P.kt = row_major ? nullptr : c.take((size_t)key_maps * P.d * P.nk_pad);
    scratch.clear();
    for (int t = 0; t < n_workers; ++t) scratch.emplace_back(P, c);
    if (pass == 0) {
      try {  // allocated here, so that running out of memory is an error code, not a crash
        c.base = work_block(c.used);
      } catch (const std::bad_alloc&) {
        return -2;
      }
    }
  }
  std::atomic<bool> seen{false};
  std::atomic<bool>* scan = P.scan ? &seen : nullptr;
  if (!row_major || scan) {  // row-major scores: no transposed k, only the scan
    run_items(key_maps * key_tiles, n_workers, [&](int, long i) {
      const long m = i / key_tiles;
      const int j0 = (int)(i % key_tiles) * SCORE_COLS;
      if (!row_major) transpose_keys(P, m, j0);
      if (scan && !finite_keys(P, m, j0, std::min(j0 + SCORE_COLS, P.nk))) seen.store(true, std::memory_order_relaxed);
    });
  }
  run_items(items, n_workers, [&](int t, long i) {
    block(P, (int)(i / blocks / P.heads), (int)(i / blocks % P.heads), (int)(i % blocks) * BQ, scratch[t], scan);
  });
  release_large_block();
  args->nonfinite = seen.load() ? 1 : 0;
  return 0;
}


// The gradients of diff_attention_cpu_forward's output for the problem `in` (see Inputs and BackwardArgs). With kept
// maps, q and k are read for dk and dq only, and the mask not at all. Returns 0; -1 for sizes it cannot take; -2 when
// out of memory.
extern "C" int diff_attention_cpu_backward(const Inputs* in, const BackwardArgs* args) {
  Grad G{*in, *args};
  G.nk_pad = (G.nk + SCORE_COLS - 1) / SCORE_COLS * SCORE_COLS;
  const int BQ = G.block_rows;
  if (BQ <= 0 || BQ % SCORE_ROWS || BQ % DQ_ROWS || G.d % 32 || G.dv % OUT_COLS || G.d <= 0 || G.nq < 0 || G.nk < 0 ||
      G.kv_heads <= 0 || G.heads % G.kv_heads)
    return -1;
  const long B = G.batch, kmaps = B * 2 * G.kv_heads, vmaps = B * G.kv_heads, heads = B * G.heads,
             ktiles = G.nk_pad / SCORE_COLS, row_blocks = (G.nq + BQ - 1) / BQ;
  if (heads == 0) return 0;  // B = 0: nothing to write
  G.groups = (int)std::clamp<long>((MIN_ITEMS + heads - 1) / heads, 1, std::max(row_blocks, 1L));
  const long items = heads * G.groups, key_items = vmaps * ktiles, transposes = (kmaps + vmaps) * ktiles;
  const int n_workers = (int)std::max(1L, std::min<long>(G.n_threads, std::max({items, key_items, transposes})));
  std::vector<GradScratch> scratch;
  Carver c;
  for (int pass = 0; pass < 2; ++pass) {  // sizes, then pieces of the block
    c.used = 0;
    G.kt = c.take((size_t)kmaps * G.d * G.nk_pad);
    G.vt = c.take((size_t)vmaps * G.dv * G.nk_pad);
    G.part = c.take((size_t)items * G.part_size());
    scratch.clear();
    for (int t = 0; t < n_workers; ++t) scratch.emplace_back(G, c);
    if (pass == 0) {
      try {  // allocated here, so that running out of memory is an error code
        c.base = work_block(c.used);
      } catch (const std::bad_alloc&) {
        return -2;
      }
    }
  }
  run_items(transposes, n_workers, [&](int, long i) {
    if (i < kmaps * ktiles && G.maps) return;  // kept maps: no scores, no k transposed
    if (i < kmaps * ktiles)
      return transpose_rows(G.lk.at(G.k, i / ktiles / (2 * G.kv_heads), i / ktiles % (2 * G.kv_heads)), G.lk.r, G.nk,
                            G.d, G.kt + (size_t)(i / ktiles) * G.d * G.nk_pad, G.nk_pad, (int)(i % ktiles) * SCORE_COLS);
    i -= kmaps * ktiles;
    transpose_rows(G.lv.at(G.v, i / ktiles / G.kv_heads, i / ktiles % G.kv_heads), G.lv.r, G.nk, G.dv,
                   G.vt + (size_t)(i / ktiles) * G.dv * G.nk_pad, G.nk_pad, (int)(i % ktiles) * SCORE_COLS);
  });
  run_items(items, n_workers, [&](int t, long i) {
    grad_group(G, (int)(i / G.groups / G.heads), (int)(i / G.groups % G.heads), (int)(i % G.groups), scratch[t]);
  });
  run_items(key_items, n_workers, [&](int, long i) {
    sum_keys(G, (int)(i / ktiles / G.kv_heads), (int)(i / ktiles % G.kv_heads), (int)(i % ktiles) * SCORE_COLS);
  });
  release_large_block();
  return 0;
}

// Frees the calling thread's kept block (the next call allocates one again).
extern "C" void diff_attention_cpu_release() {
  kept.data.reset();
  kept.size = 0;
}

// The size in bytes of the calling thread's kept block (0: none).
extern "C" long diff_attention_cpu_kept_bytes() { return (long)(kept.size * sizeof(float)); }

// Keep blocks of at most this many bytes between calls (default 64 MiB); returns the previous limit.
extern "C" long diff_attention_cpu_keep_at_most(long bytes) {
  return (long)(keep_floats.exchange((size_t)std::max(0L, bytes) / sizeof(float)) * sizeof(float));
}

// The boundary's layout, for cpu_fused.py's check of its ctypes Structures: per struct one row with an empty field
// name and its size, then one row per field (offset, size) in declaration order.
struct FieldAt {
  const char *type, *field;
  long offset, size;
};
#define DA_STRUCT(T) {#T, "", 0, (long)sizeof(T)}
#define DA_FIELD(T, F) {#T, #F, (long)offsetof(T, F), (long)sizeof(T::F)}
const FieldAt boundary_fields[] = {
    DA_STRUCT(Layout), DA_FIELD(Layout, b), DA_FIELD(Layout, h), DA_FIELD(Layout, r),
    DA_STRUCT(Inputs), DA_FIELD(Inputs, q), DA_FIELD(Inputs, k), DA_FIELD(Inputs, v), DA_FIELD(Inputs, lam),
    DA_FIELD(Inputs, mask), DA_FIELD(Inputs, lq), DA_FIELD(Inputs, lk), DA_FIELD(Inputs, lv),
    DA_FIELD(Inputs, mask_b), DA_FIELD(Inputs, mask_h), DA_FIELD(Inputs, mask_q), DA_FIELD(Inputs, mask_k),
    DA_FIELD(Inputs, batch), DA_FIELD(Inputs, heads), DA_FIELD(Inputs, kv_heads), DA_FIELD(Inputs, nq),
    DA_FIELD(Inputs, nk), DA_FIELD(Inputs, d), DA_FIELD(Inputs, dv), DA_FIELD(Inputs, block_rows),
    DA_FIELD(Inputs, causal), DA_FIELD(Inputs, n_threads), DA_FIELD(Inputs, qk_scale), DA_FIELD(Inputs, exp_scale),
    DA_STRUCT(ForwardArgs), DA_FIELD(ForwardArgs, out), DA_FIELD(ForwardArgs, maps), DA_FIELD(ForwardArgs, lo),
    DA_FIELD(ForwardArgs, scan), DA_FIELD(ForwardArgs, nonfinite),
    DA_STRUCT(BackwardArgs), DA_FIELD(BackwardArgs, dout), DA_FIELD(BackwardArgs, maps), DA_FIELD(BackwardArgs, gq),
    DA_FIELD(BackwardArgs, gk), DA_FIELD(BackwardArgs, gv), DA_FIELD(BackwardArgs, glam), DA_FIELD(BackwardArgs, ldo),
    DA_FIELD(BackwardArgs, lgq), DA_FIELD(BackwardArgs, lgk), DA_FIELD(BackwardArgs, lgv),
};
static_assert(std::is_standard_layout_v<Layout> && std::is_standard_layout_v<Inputs> &&
              std::is_standard_layout_v<ForwardArgs> && std::is_standard_layout_v<BackwardArgs>,
              "the boundary's structs must have C's layout (ctypes mirrors them)");
#undef DA_STRUCT
#undef DA_FIELD

// The rows of boundary_fields: *rows points at them; returns how many.
extern "C" int diff_attention_cpu_fields(const FieldAt** rows) {
  *rows = boundary_fields;
  return (int)(sizeof(boundary_fields) / sizeof(boundary_fields[0]));
}
