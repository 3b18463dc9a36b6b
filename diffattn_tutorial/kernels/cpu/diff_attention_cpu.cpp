// Differential attention, forward, fused on a CPU: naive's arithmetic in one pass per block of query rows.
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
// fixed order, so the output does not depend on the thread count.
//
// The scores and the mask stay in natural units, as naive's (S + mask, then S - rowmax): an additive mask
// anywhere in float32's range gives naive's answer (converting it to base-2 units first would overflow beyond
// about 2.4e38); only the difference to the row's maximum is multiplied by LOG2E, for exp2.
//
// The Python side (diffattn_tutorial/kernels/cpu/cpu_fused.py) passes contiguous float32 q, k, v (a head width that is
// a multiple of 32, zero-padded there if need be), lam expanded to (B, H, Nq), the mask (if any) as float32
// with element strides. The kernel first transposes k to (d, Nk) per map, in parallel, for the score tiles.
// Build: c++ -O3 -march=native -std=c++17 -shared -fPIC -pthread (no PyTorch headers; called through ctypes).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register, two AVX2, four NEON
typedef int32_t vi16 __attribute__((vector_size(64)));
constexpr int VL = 16;

constexpr int SCORE_ROWS = 8;    // score tile: 8 query rows x 32 keys = 16 vector accumulators
constexpr int SCORE_COLS = 32;
constexpr int OUT_ROWS = 6;      // output tile: 6 query rows x 64 value columns = 24 vector accumulators
constexpr int OUT_COLS = 64;
constexpr int KEY_CHUNK = 256;   // keys per pass of P . V (a 256 x 64 slice of V stays in L1/L2)

inline v16 splat(float x) { return v16{} + x; }
inline v16 load(const float* p) { v16 r; std::memcpy(&r, p, sizeof r); return r; }
inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }
inline float hsum(v16 x) { float t = 0; for (int i = 0; i < VL; ++i) t += x[i]; return t; }
inline float hmax(v16 x) { float t = x[0]; for (int i = 1; i < VL; ++i) t = x[i] > t ? x[i] : t; return t; }

// 2^x for x <= 0; x < -127 gives 0. x = n + f with n = round(x), |f| <= 1/2; 2^f by the Cephes exp2f
// polynomial (relative error ~1e-7), 2^n by writing n into the float's exponent bits.
inline v16 exp2_neg(v16 x) {
  x = x < -127.0f ? splat(-127.0f) : x;
  const v16 round_magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const v16 n = (x + round_magic) - round_magic;
  const v16 f = x - n;
  v16 p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  return p * (v16)bits;
}

// S[r][j0 : j0 + 32] = scale * sum_c q[r][c] * kt[c][j0 : j0 + 32] for SCORE_ROWS rows of q (row stride d).
inline void score_tile(const float* q, int d, const float* kt, int ldk, int j0, float* s, int lds, float scale) {
  v16 acc[SCORE_ROWS][2] = {};
  for (int c = 0; c < d; ++c) {
    const v16 k0 = load(kt + (size_t)c * ldk + j0), k1 = load(kt + (size_t)c * ldk + j0 + VL);
    for (int r = 0; r < SCORE_ROWS; ++r) {
      const v16 a = splat(q[(size_t)r * d + c]);
      acc[r][0] += a * k0;
      acc[r][1] += a * k1;
    }
  }
  for (int r = 0; r < SCORE_ROWS; ++r) {
    store(s + (size_t)r * lds + j0, acc[r][0] * scale);
    store(s + (size_t)r * lds + j0 + VL, acc[r][1] * scale);
  }
}

// O[r][c0 : c0 + 64] (+)= sum_{j0 <= j < j1} P[r][j] * V[j][c0 : c0 + 64] for OUT_ROWS rows.
inline void out_tile(const float* p, int ldp, int j0, int j1, const float* v, int dv, int c0, float* o, bool first) {
  v16 acc[OUT_ROWS][4];
  for (int r = 0; r < OUT_ROWS; ++r)
    for (int x = 0; x < 4; ++x) acc[r][x] = first ? v16{} : load(o + (size_t)r * dv + c0 + VL * x);
  for (int j = j0; j < j1; ++j) {
    const float* vr = v + (size_t)j * dv + c0;
    const v16 v0 = load(vr), v1 = load(vr + VL), v2 = load(vr + 2 * VL), v3 = load(vr + 3 * VL);
    for (int r = 0; r < OUT_ROWS; ++r) {
      const v16 a = splat(p[(size_t)r * ldp + j]);
      acc[r][0] += a * v0;
      acc[r][1] += a * v1;
      acc[r][2] += a * v2;
      acc[r][3] += a * v3;
    }
  }
  for (int r = 0; r < OUT_ROWS; ++r)
    for (int x = 0; x < 4; ++x) store(o + (size_t)r * dv + c0 + VL * x, acc[r][x]);
}

// One row of scores: add the mask row (key stride 0 or 1), replace s[j] by exp2((s[j] - max) * exp_scale)
// (exp_scale = LOG2E: e^(s[j] - max)) for the nvis visible keys and by 0 up to npad. Returns the row sum;
// 0 when every visible score is -inf (the caller then writes a zero row).
inline float softmax_numerators(float* s, int nvis, int npad, const float* mask, long mask_key_stride,
                                float exp_scale) {
  const int nv = nvis / VL * VL;
  if (mask && mask_key_stride == 1) {
    for (int j = 0; j < nv; j += VL) store(s + j, load(s + j) + load(mask + j));
    for (int j = nv; j < nvis; ++j) s[j] += mask[j];
  } else if (mask) {
    for (int j = 0; j < nvis; ++j) s[j] += mask[0];
  }
  v16 mv = splat(-INFINITY);
  for (int j = 0; j < nv; j += VL) { const v16 x = load(s + j); mv = x > mv ? x : mv; }
  float m = hmax(mv);
  for (int j = nv; j < nvis; ++j) m = s[j] > m ? s[j] : m;
  if (m == -INFINITY) return 0.0f;
  mv = splat(m);
  const v16 es = splat(exp_scale);
  v16 sum = {};
  for (int j = 0; j < nv; j += VL) { const v16 e = exp2_neg((load(s + j) - mv) * es); store(s + j, e); sum += e; }
  float total = hsum(sum);
  for (int j = nv; j < nvis; ++j) { s[j] = std::exp2((s[j] - m) * exp_scale); total += s[j]; }
  for (int j = nvis; j < npad; ++j) s[j] = 0.0f;
  return total;
}

struct Problem {
  const float *q, *k, *v, *lam, *mask;
  float* kt;  // k transposed per map, (B, 2Hkv, d, nk_pad), zero beyond nk: filled by transpose_keys
  float* out;
  int batch, heads, kv_heads, nq, nk, nk_pad, d, dv, block_rows;
  float qk_scale;                       // the softmax scale: scores in natural units, as naive's
  long mask_b, mask_h, mask_q, mask_k;  // element strides of the (B, H, Nq, Nk) mask view (0 where broadcast)
  float exp_scale;                      // LOG2E: exp2((s - max) * exp_scale) = e^(s - max)
  bool causal;                          // bottom-right aligned: row i sees keys j <= i + nk - nq
};

// Per-thread buffers: two block_rows x nk_pad score blocks; for the last, partial block of rows, its queries
// zero-padded and its output rows.
struct Scratch {
  std::vector<float> s1, s2, q1, q2, out;
  Scratch(const Problem& P)
      : s1((size_t)P.block_rows * P.nk_pad), s2(s1.size()), q1((size_t)P.block_rows * P.d), q2(q1.size()),
        out((size_t)P.block_rows * P.dv) {}
};

// Work item of the first phase: keys [j0, j0 + 32) of key map m (of B * 2Hkv) into kt, transposed.
void transpose_keys(const Problem& P, long m, int j0) {
  const float* k = P.k + (size_t)m * P.nk * P.d;
  float* kt = P.kt + (size_t)m * P.d * P.nk_pad;
  for (int c = 0; c < P.d; ++c)
    for (int j = j0; j < j0 + SCORE_COLS; ++j) kt[(size_t)c * P.nk_pad + j] = j < P.nk ? k[(size_t)j * P.d + c] : 0.0f;
}

// Work item of the second phase: rows [r0, r0 + block_rows) of head h in batch b.
void block(const Problem& P, int b, int h, int r0, Scratch& w) {
  const int g = h / (P.heads / P.kv_heads), BQ = P.block_rows, rows = std::min(BQ, P.nq - r0);
  const float* q1 = P.q + (((size_t)b * 2 * P.heads + 2 * h) * P.nq + r0) * P.d;
  const float* q2 = q1 + (size_t)P.nq * P.d;
  if (rows < BQ) {  // the last block: copy its rows into zero-padded buffers
    std::fill(w.q1.begin(), w.q1.end(), 0.0f);
    std::fill(w.q2.begin(), w.q2.end(), 0.0f);
    std::copy(q1, q1 + (size_t)rows * P.d, w.q1.begin());
    std::copy(q2, q2 + (size_t)rows * P.d, w.q2.begin());
    q1 = w.q1.data();
    q2 = w.q2.data();
  }
  float *s1 = w.s1.data(), *s2 = w.s2.data();
  const float* k1 = P.kt + ((size_t)b * 2 * P.kv_heads + 2 * g) * P.d * P.nk_pad;
  const float* k2 = k1 + (size_t)P.d * P.nk_pad;
  const float* vg = P.v + ((size_t)b * P.kv_heads + g) * P.nk * P.dv;
  const float* lam = P.lam + ((size_t)b * P.heads + h) * P.nq + r0;
  float* o_rows = P.out + (((size_t)b * P.heads + h) * P.nq + r0) * P.dv;
  float* o = rows < BQ ? w.out.data() : o_rows;
  const int shift = P.nk - P.nq;  // causal: row i sees keys j < i + 1 + shift
  const int kmax = P.causal ? std::clamp(r0 + BQ + shift, 0, P.nk) : P.nk;
  const int kpad = (kmax + SCORE_COLS - 1) / SCORE_COLS * SCORE_COLS;
  for (int j0 = 0; j0 < kpad; j0 += SCORE_COLS)
    for (int r = 0; r < BQ; r += SCORE_ROWS) {
      score_tile(q1 + (size_t)r * P.d, P.d, k1, P.nk_pad, j0, s1 + (size_t)r * P.nk_pad, P.nk_pad, P.qk_scale);
      score_tile(q2 + (size_t)r * P.d, P.d, k2, P.nk_pad, j0, s2 + (size_t)r * P.nk_pad, P.nk_pad, P.qk_scale);
    }
  for (int r = 0; r < BQ; ++r) {
    const int row = r0 + r;
    const int nvis = P.causal ? std::clamp(row + 1 + shift, 0, kmax) : kmax;
    const float* mrow = P.mask && row < P.nq ? P.mask + b * P.mask_b + h * P.mask_h + row * P.mask_q : nullptr;
    float* p1 = s1 + (size_t)r * P.nk_pad;
    float* p2 = s2 + (size_t)r * P.nk_pad;
    const float l1 = softmax_numerators(p1, nvis, kpad, mrow, P.mask_k, P.exp_scale);
    const float l2 = softmax_numerators(p2, nvis, kpad, mrow, P.mask_k, P.exp_scale);
    if (l1 == 0.0f || l2 == 0.0f) { std::memset(p1, 0, sizeof(float) * kpad); continue; }
    const v16 a1 = splat(1.0f / l1), a2 = splat((row < P.nq ? lam[r] : 0.0f) / l2);
    for (int j = 0; j < kpad; j += VL) store(p1 + j, load(p1 + j) * a1 - load(p2 + j) * a2);
  }
  for (int j0 = 0; j0 < std::max(kpad, 1); j0 += KEY_CHUNK)
    for (int c0 = 0; c0 < P.dv; c0 += OUT_COLS)
      for (int r = 0; r < BQ; r += OUT_ROWS)
        out_tile(s1 + (size_t)r * P.nk_pad, P.nk_pad, j0, std::min({kpad, P.nk, j0 + KEY_CHUNK}), vg, P.dv, c0,
                 o + (size_t)r * P.dv, j0 == 0);  // P is 0 beyond nk: V's rows there are never read
  if (rows < BQ) std::copy(o, o + (size_t)rows * P.dv, o_rows);
}

// Runs item(t, i) for i in [0, items) on n_workers threads (t: the thread's index), handing items out through
// one atomic counter. A thread that cannot be started leaves its share to the others.
template <class Item>
void run_items(long items, int n_workers, Item item) {
  std::atomic<long> next{0};
  auto worker = [&](int t) {
    for (long i; (i = next.fetch_add(1)) < items;) item(t, i);
  };
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

}  // namespace

// q (B, 2H, nq, d), k (B, 2Hkv, nk, d), v (B, Hkv, nk, dv) and lam (B, H, nq) contiguous float32; the mask
// (if any) float32 with element strides mask_strides (0 where broadcast, 1 or 0 along keys); out (B, H, nq, dv).
// exp_scale: LOG2E; qk_scale: the softmax scale. sizes: B, H, Hkv, nq, nk, d, dv, block_rows.
// Returns 0; -1 for sizes it cannot take; -2 when out of memory.
extern "C" int diff_attention_cpu_forward(const float* q, const float* k, const float* v, const float* lam,
                                          const float* mask, const long* mask_strides, float exp_scale,
                                          float qk_scale, float* out, const int* sizes, int causal, int n_threads) {
  Problem P{q, k, v, lam, mask, nullptr, out,
            sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], 0, sizes[5], sizes[6], sizes[7], qk_scale,
            mask_strides[0], mask_strides[1], mask_strides[2], mask_strides[3], exp_scale, causal != 0};
  P.nk_pad = (P.nk + SCORE_COLS - 1) / SCORE_COLS * SCORE_COLS;
  const int BQ = P.block_rows;
  if (BQ <= 0 || BQ % SCORE_ROWS || BQ % OUT_ROWS || P.dv % OUT_COLS || P.d <= 0 || P.nq < 0 || P.nk < 0 ||
      P.kv_heads <= 0 || P.heads % P.kv_heads)
    return -1;
  const long key_maps = (long)P.batch * 2 * P.kv_heads, key_tiles = P.nk_pad / SCORE_COLS;
  const long blocks = (P.nq + BQ - 1) / BQ, items = (long)P.batch * P.heads * blocks;
  const int n_workers = (int)std::max(1L, std::min<long>(n_threads, std::max(items, key_maps * key_tiles)));
  std::vector<float> kt;
  std::vector<Scratch> scratch;  // allocated here, so that running out of memory is an error code, not a crash
  try {
    kt.resize((size_t)key_maps * P.d * P.nk_pad);
    for (int t = 0; t < n_workers; ++t) scratch.emplace_back(P);
  } catch (const std::bad_alloc&) {
    return -2;
  }
  P.kt = kt.data();
  run_items(key_maps * key_tiles, n_workers,
            [&](int, long i) { transpose_keys(P, i / key_tiles, (int)(i % key_tiles) * SCORE_COLS); });
  run_items(items, n_workers, [&](int t, long i) {
    block(P, (int)(i / blocks / P.heads), (int)(i / blocks % P.heads), (int)(i % blocks) * BQ, scratch[t]);
  });
  return 0;
}
