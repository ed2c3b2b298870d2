// restore_rope: write a saved KV segment into paged-cache slots, rotating keys to their new positions.
//
// One body per path, instantiated for five storage types; extern "C" entry points restore_rope_<type>
// (vector path) and restore_rope_<type>_elem (element path), <type> in {f32, f16, bf16, e4m3, e5m2}: two
// kernels so that each gets the registers it needs, not the larger of the two. Semantics are
// kmesh.restore's torch path, bit for bit:
//   moved token, rotary channel pair (x1, x2) with tables (c, s) of (new - old)·ω (float32, from float64):
//     o1 = x1·c − x2·s,  o2 = x2·c + x1·s   (float32, each product and sum rounded: no FMA contraction)
//     result cast to the storage type by round-to-nearest-even (fp8: x = fp8·scale before, fp8(o·inv_scale)
//     saturated to the largest finite value after);
//   everything else (values, non-rotary key channels, keys of tokens that do not move) copied as bits.
//
// Memory layout
//   src_k [T, L, H, Dk] and src_v [T, L, H, Dv], contiguous, storage type S (uint8 for fp8); or, with
//   src_tok set, gathered straight from a paged source (a child's private copy of the export buffer): token t's
//   (layer l, head h) key row at src_k + src_tok[t] + l·sk_L + h·sk_H (values: src_v, sv_*), channels
//   contiguous, so a restore is one launch with no separate capture copy.
//   cos, sin [T, rot/2] float32; slots [T] int64 (−1 = padding, skipped); moved [T] uint8.
//   dst: flat cache of S. K element (layer l, block b, head h, token-in-block n, channel c) at
//     k_off + (layer_base + l)·k_sL + b·k_sB + h·k_sH + n·k_sN + c·k_sC   (V likewise with v_*),
//   b = slot / block_size, n = slot % block_size. This covers every arrangement kmesh.layout knows:
//   paged [K|V] cells in any of the six orders (k_sC = 1), vLLM CPU planes (K transposed: k_sN = 1,
//   k_sC = block_size) and MLA latents (rotary part at channels [rot_start, rot_start + rot)).
//   In vLLM's default paged order (LBNHC) one (token, layer) is one contiguous run of H·(Dk + Dv)
//   elements (H × 256–512 B for the benchmark shapes); K and V halves of a head cell are separate
//   128/256-byte pieces, each written whole by neighbouring threads.
//
// Vector path (restore_rope_<type>; all channel strides 1, widths/offsets multiples of a 16-byte chunk,
// aligned pointers): a flat grid of units, one unit per thread (RESTORE_G per thread as an option).
// Units are numbered token-major; within a token first its L·H·n_rot rotary units, then its L·H·n_cp
// copy units (both row-major, row = (layer, head), layer-major), so that a warp mostly does one kind of
// work (rotation or plain copy) and consecutive threads touch consecutive chunks:
//   rotary unit: neox = a rotary chunk at c and its partner at c + rot/2 (RVEC pairs);
//                gptj = one rotary chunk of RVEC/2 adjacent pairs. Rotary chunk = RESTORE_ROT_CHUNK bytes
//                (8 by default: 4 bf16/f16 pairs), fp8: RESTORE_FP8_ROT_CHUNK (8: 8 pairs);
//                RVEC = chunk / sizeof(S).
//   copy unit:   one 16-byte chunk of a non-rotary key channel range or of the values, copied as bits.
// Unit id -> (token, unit-in-token) -> (row, chunk) -> (layer, head), and slot -> (block, offset), by
// multiply-high divisions whose magic numbers the launcher computes (FastDiv). A thread issues its
// slot, flag, data and (rotary units) shift-table loads before it waits on any of them, then rotates
// and stores. Launch: grid.x = ceil(units / (RESTORE_THREADS·RESTORE_G)), block = RESTORE_THREADS = 256
// threads, one launch per restore (restores of >= 2^31 units: several launches over token ranges).
// Registers (nvcc 13.0, sm_90, defaults): 32 bf16/f16, 30 f32, 40 e4m3/e5m2, no spills — up to
// 2048 / 1536 resident threads per SM.
// Element path (restore_rope_<type>_elem; any strides, e.g. the CPU backend's transposed K plane):
// one block z-slice per token; block (bx, by, bz): bx = items per row (one pair or element each,
// <= 256), by threads walk the token's L·H rows, bz tokens per block; grid.x = ceil(T / bz).
// H200 measurements (both paths validated, vector path timed): docs/measurements/restore_h200.md.
//
// Bytes: reads T·L·H·(Dk + Dv)·sizeof(S) of segment + T·rot/2·8 of tables + 9·T of slots/flags;
// writes the same T·L·H·(Dk + Dv)·sizeof(S) into the cache (padding tokens: nothing). Every segment
// byte is read once and every destination byte written once (16-byte loads/stores; tables and slots
// are re-read per unit from L1/L2), as the copy baseline of the restore_bench stage counts read + write.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// Tunables (compile-time; the defaults are what the kernels stage builds: the best configuration measured
// on the H200, bf16 and e4m3 timed, f16/f32 sharing the bf16 settings and e5m2 the e4m3 ones; kmesh.cuda
// reads the same -D flags to size its launch): threads per block,
// units per thread on the vector path (their loads all issued before the first store), bytes per
// rotary chunk (16, 8 or 4; fp8 caches: RESTORE_FP8_ROT_CHUNK; copy chunks are always 16), packed
// two-at-a-time fp8 conversions (same results, fewer instructions), shift tables loaded with the data
// (1) or only once the token is known to move (0), streaming cache hints on segment loads and cache
// stores (see Io; per type family), and the minimum resident blocks per multiprocessor asked of the
// compiler (1 = no register cap beyond 255).
#ifndef RESTORE_THREADS
#define RESTORE_THREADS 256
#endif
#ifndef RESTORE_G
#define RESTORE_G 1
#endif
#ifndef RESTORE_ROT_CHUNK
#define RESTORE_ROT_CHUNK 8
#endif
#ifndef RESTORE_FP8_ROT_CHUNK
#define RESTORE_FP8_ROT_CHUNK 8
#endif
#ifndef RESTORE_FP8_X2
#define RESTORE_FP8_X2 1
#endif
#ifndef RESTORE_EARLY_TABLES
#define RESTORE_EARLY_TABLES 1
#endif
#ifndef RESTORE_STREAMING
#define RESTORE_STREAMING 1
#endif
#ifndef RESTORE_FP8_STREAMING
#define RESTORE_FP8_STREAMING 1
#endif
#ifndef RESTORE_MIN_BLOCKS
#define RESTORE_MIN_BLOCKS 1
#endif

namespace {

// Storage traits: element <-> float32 (fp8: ×scale after decoding, ×inv_scale before encoding), singly
// and for two adjacent elements (packed instructions where the format has them); ROT_CHUNK = bytes per
// rotary chunk on the vector path.
template <class Self, class S_>
struct Scalar2 {
    __device__ static float2 load2(S_ a, S_ b, float scale) { return make_float2(Self::load(a, scale), Self::load(b, scale)); }
    __device__ static void store2(float x, float y, float inv, S_& a, S_& b) { a = Self::store(x, inv); b = Self::store(y, inv); }
};
struct F32 : Scalar2<F32, float> {
    using S = float;
    static constexpr int ROT_CHUNK = RESTORE_ROT_CHUNK < 8 ? 8 : RESTORE_ROT_CHUNK;   // at least one neox pair
    static constexpr bool STREAM = RESTORE_STREAMING;
    __device__ static float load(S v, float) { return v; }
    __device__ static S store(float x, float) { return x; }
};
struct F16 : Scalar2<F16, __half> {
    using S = __half;
    static constexpr int ROT_CHUNK = RESTORE_ROT_CHUNK;
    static constexpr bool STREAM = RESTORE_STREAMING;
    __device__ static float load(S v, float) { return __half2float(v); }
    __device__ static S store(float x, float) { return __float2half_rn(x); }
};
struct BF16 : Scalar2<BF16, __nv_bfloat16> {
    using S = __nv_bfloat16;
    static constexpr int ROT_CHUNK = RESTORE_ROT_CHUNK;
    static constexpr bool STREAM = RESTORE_STREAMING;
    __device__ static float load(S v, float) { return __bfloat162float(v); }
    __device__ static S store(float x, float) { return __float2bfloat16_rn(x); }
};
template <__nv_fp8_interpretation_t KIND>
struct FP8 {
    using S = unsigned char;
    static constexpr int ROT_CHUNK = RESTORE_FP8_ROT_CHUNK;
    static constexpr bool STREAM = RESTORE_FP8_STREAMING;
    __device__ static float load(S v, float scale) {
        __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), KIND);
        return __fmul_rn(__half2float(__half(h)), scale);
    }
    __device__ static S store(float x, float inv_scale) {
        return static_cast<S>(__nv_cvt_float_to_fp8(__fmul_rn(x, inv_scale), __NV_SATFINITE, KIND));
    }
    __device__ static float2 load2(S a, S b, float scale) {
#if RESTORE_FP8_X2
        const __nv_fp8x2_storage_t v = (__nv_fp8x2_storage_t)(a | (b << 8));   // low byte = first element = .x
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(v, KIND)));
        return make_float2(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
#else
        return make_float2(load(a, scale), load(b, scale));
#endif
    }
    __device__ static void store2(float x, float y, float inv, S& a, S& b) {
#if RESTORE_FP8_X2
        const __nv_fp8x2_storage_t v =
            __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(x, inv), __fmul_rn(y, inv)), __NV_SATFINITE, KIND);
        a = (S)(v & 0xff);
        b = (S)(v >> 8);
#else
        a = store(x, inv);
        b = store(y, inv);
#endif
    }
};

// n / d for n < 2^31, d < 2^31 as ((n·m) >> 32 + n) >> s with m, s from the launcher (s = ceil(log2 d),
// m = floor(2^32·(2^s − d)/d) + 1): two integer instructions instead of a division loop.
struct FastDiv {
    unsigned d, m, s;
};
__device__ __forceinline__ unsigned fdiv(unsigned n, const FastDiv& f) {
    return ((unsigned)(((unsigned long long)n * f.m) >> 32) + n) >> f.s;
}

struct Args {  // kernel parameters, in launch order
    void* dst;
    const void* src_k;
    const void* src_v;
    const long long* slots;
    const unsigned char* moved;
    const float* cos_t;
    const float* sin_t;
    long long k_off, k_sL, k_sB, k_sH, k_sN, k_sC;
    long long v_off, v_sL, v_sB, v_sH, v_sN, v_sC;
    int n_tokens, n_layers, n_heads, dk, dv, block_size, layer_base, rot_start, rot, neox;
    float scale, inv_scale;
    // vector path: units of this launch, rotary units per token, plain-key copy units per row;
    // divisors of units per token, rotary units per row, copy units per row, heads, block size
    unsigned units, rot_units, kp_units;
    FastDiv per_token, rot_row, cp_row, heads, bsz;
    // gather from a paged source (null: the contiguous segment above): token t's (layer 0, head 0) row at
    // src_k + src_tok[t] (V: src_v + src_tok[t]), layer l and head h at + l·s*_L + h·s*_H, channels contiguous
    const long long* src_tok;
    long long sk_L, sk_H, sv_L, sv_H;
};

// First element of the (token t, layer l, head h) row of the segment's keys (values: v = true). GATHER: the
// source is paged (src_tok); -1: decided at run time from src_tok (element path); 0: the contiguous segment.
template <class S, int GATHER = -1>
__device__ __forceinline__ const S* src_row(const Args& a, unsigned long long t, long long l, long long h,
                                            unsigned long long srow, bool v) {
    if (GATHER == 1 || (GATHER == -1 && a.src_tok != nullptr)) {
        const long long base = __ldg(a.src_tok + t);
        return v ? static_cast<const S*>(a.src_v) + base + l * a.sv_L + h * a.sv_H
                 : static_cast<const S*>(a.src_k) + base + l * a.sk_L + h * a.sk_H;
    }
    return v ? static_cast<const S*>(a.src_v) + srow * a.dv : static_cast<const S*>(a.src_k) + srow * a.dk;
}

__device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float s, float& o1, float& o2) {
    o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// One 16-byte register chunk; a smaller rotary chunk (8 or 4 bytes, tuning options) lives in its first bytes.
template <class S>
union Bits {
    uint4 u;
    S e[16 / sizeof(S)];
};
// Segment loads and cache stores of one chunk. STREAM (the type's RESTORE_STREAMING /
// RESTORE_FP8_STREAMING) marks both as used once (ld/st .cs, evict first) instead of the read-only path
// for loads and default caching for stores.
template <int BYTES, bool STREAM>
struct Io {
    static_assert(BYTES == 16 || BYTES == 8 || BYTES == 4, "chunks are 16, 8 or 4 bytes");
    template <class V>
    __device__ static V load(const V* p) {
        if constexpr (STREAM) return __ldcs(p);
        else return __ldg(p);
    }
    template <class V>
    __device__ static void store(V* p, const V& v) {
        if constexpr (STREAM) __stcs(p, v);
        else *p = v;
    }
    __device__ static uint4 ld(const void* p) {
        if constexpr (BYTES == 16) {
            return load(reinterpret_cast<const uint4*>(p));
        } else if constexpr (BYTES == 8) {
            const uint2 v = load(reinterpret_cast<const uint2*>(p));
            return make_uint4(v.x, v.y, 0u, 0u);
        } else {
            return make_uint4(load(reinterpret_cast<const unsigned*>(p)), 0u, 0u, 0u);
        }
    }
    __device__ static void st(void* p, const uint4& v) {
        if constexpr (BYTES == 16) store(reinterpret_cast<uint4*>(p), v);
        else if constexpr (BYTES == 8) store(reinterpret_cast<uint2*>(p), make_uint2(v.x, v.y));
        else store(reinterpret_cast<unsigned*>(p), v.x);
    }
};

// Table loads: n consecutive floats at p (aligned to 4·n bytes when n is 2 or a multiple of 4).
template <int N>
__device__ __forceinline__ void load_table(const float* p, float* out) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int j = 0; j < N; j += 4) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(p + j));
            out[j] = v.x; out[j + 1] = v.y; out[j + 2] = v.z; out[j + 3] = v.w;
        }
    } else if constexpr (N == 2) {
        const float2 v = __ldg(reinterpret_cast<const float2*>(p));
        out[0] = v.x; out[1] = v.y;
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) out[j] = __ldg(p + j);
    }
}

// Shift tables of rotary unit j of token t: neox RVEC entries (one per pair of chunks p, q), gptj RVEC/2.
template <int RVEC>
__device__ __forceinline__ void unit_tables(const Args& a, unsigned t, unsigned j, bool neox, float* cs, float* sn) {
    const unsigned half = (unsigned)a.rot / 2;
    const unsigned long long at = (unsigned long long)t * half;
    if (neox) {
        load_table<RVEC>(a.cos_t + at + j * RVEC, cs);
        load_table<RVEC>(a.sin_t + at + j * RVEC, sn);
    } else {
        load_table<RVEC / 2>(a.cos_t + at + j * (RVEC / 2), cs);
        load_table<RVEC / 2>(a.sin_t + at + j * (RVEC / 2), sn);
    }
}

// Rotate one rotary unit in registers: neox = chunk p (first halves x1) with chunk q (x2);
// gptj = chunk p of adjacent pairs.
template <class Tr, int RVEC>
__device__ __forceinline__ void rotate_unit(const Args& a, const float* cs, const float* sn,
                                            Bits<typename Tr::S>& p, Bits<typename Tr::S>& q) {
    if (a.neox) {
#pragma unroll
        for (int e = 0; e < RVEC; e += 2) {
            const float2 x1 = Tr::load2(p.e[e], p.e[e + 1], a.scale);
            const float2 x2 = Tr::load2(q.e[e], q.e[e + 1], a.scale);
            float o1a, o2a, o1b, o2b;
            rotate_pair(x1.x, x2.x, cs[e], sn[e], o1a, o2a);
            rotate_pair(x1.y, x2.y, cs[e + 1], sn[e + 1], o1b, o2b);
            Tr::store2(o1a, o1b, a.inv_scale, p.e[e], p.e[e + 1]);
            Tr::store2(o2a, o2b, a.inv_scale, q.e[e], q.e[e + 1]);
        }
    } else {
#pragma unroll
        for (int e = 0; e < RVEC / 2; ++e) {
            const float2 x = Tr::load2(p.e[2 * e], p.e[2 * e + 1], a.scale);
            float o1, o2;
            rotate_pair(x.x, x.y, cs[e], sn[e], o1, o2);
            Tr::store2(o1, o2, a.inv_scale, p.e[2 * e], p.e[2 * e + 1]);
        }
    }
}

// Vector path: RESTORE_G units of a block's RESTORE_THREADS·RESTORE_G consecutive units per thread
// (unit g of thread x = block·THREADS·G + g·THREADS + x, so a warp's accesses stay contiguous).
// All loads of all its units (slot, flag, data and, with RESTORE_EARLY_TABLES, the shift tables) are
// issued before anything waits on them.
template <class Tr, bool GATHER>
__device__ __forceinline__ void fast_units(const Args& a, unsigned block, unsigned thread) {
    using S = typename Tr::S;
    constexpr int VEC = 16 / sizeof(S);
    constexpr int RC = Tr::ROT_CHUNK;
    constexpr int RVEC = RC / sizeof(S);
    static_assert(RVEC % 2 == 0 && VEC % RVEC == 0, "a rotary chunk holds an even number of elements");
    constexpr int G = RESTORE_G;
    using IoR = Io<RC, Tr::STREAM>;   // rotary chunks
    using IoC = Io<16, Tr::STREAM>;   // copy chunks
    S* dst = static_cast<S*>(a.dst);
    const unsigned LH = (unsigned)(a.n_layers * a.n_heads);
    const unsigned half = (unsigned)a.rot / 2;
    Bits<S> p[G], q[G];
    long long slot[G];
    unsigned tok[G], row[G], sub[G];
    int kind[G], chan[G];
    bool moved[G];
    float cs[G][RVEC], sn[G][RVEC];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const unsigned id = block * (RESTORE_THREADS * G) + g * RESTORE_THREADS + thread;
        kind[g] = -1;
        if (id >= a.units) continue;
        const unsigned t = fdiv(id, a.per_token);
        unsigned u = id - t * a.per_token.d;
        const bool rot = u < a.rot_units;
        if (!rot) u -= a.rot_units;
        const FastDiv& per_row = rot ? a.rot_row : a.cp_row;
        const unsigned r = fdiv(u, per_row);
        const unsigned j = u - r * per_row.d;
        int k, c;
        if (rot) {
            k = 0;
            c = a.rot_start + (int)j * RVEC;
        } else if (j < a.kp_units) {
            k = 1;
            const int pch = (int)j * VEC;
            c = pch < a.rot_start ? pch : pch + a.rot;
        } else {
            k = 2;
            c = (int)(j - a.kp_units) * VEC;
        }
        const unsigned srow = t * LH + r;
        const S* src;
        if constexpr (GATHER) {
            const unsigned sl = fdiv(r, a.heads);
            src = src_row<S, 1>(a, t, sl, r - sl * a.heads.d, srow, k == 2) + c;
        } else {
            src = src_row<S, 0>(a, t, 0, 0, srow, k == 2) + c;
        }
        slot[g] = __ldg(a.slots + t);
        if (k == 0) {
            p[g].u = IoR::ld(src);
            if (a.neox) q[g].u = IoR::ld(src + half);
            moved[g] = __ldg(a.moved + t) != 0;
#if RESTORE_EARLY_TABLES
            unit_tables<RVEC>(a, t, j, a.neox, cs[g], sn[g]);
#endif
        } else {
            p[g].u = IoC::ld(src);
        }
        kind[g] = k;
        chan[g] = c;
        tok[g] = t;
        row[g] = r;
        sub[g] = j;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (kind[g] < 0 || slot[g] < 0) continue;  // past the end, or a padding token: writes nothing
        const unsigned s32 = (unsigned)slot[g];     // host checks num_slots < 2^31
        const unsigned b32 = fdiv(s32, a.bsz);
        const long long b = b32, n = s32 - b32 * a.bsz.d;
        const unsigned l = fdiv(row[g], a.heads);
        const long long h = row[g] - l * a.heads.d;
        const long long lk = a.layer_base + (long long)l;
        if (kind[g] == 2) {
            IoC::st(dst + a.v_off + lk * a.v_sL + b * a.v_sB + h * a.v_sH + n * a.v_sN + chan[g], p[g].u);
            continue;
        }
        S* cell = dst + a.k_off + lk * a.k_sL + b * a.k_sB + h * a.k_sH + n * a.k_sN + chan[g];
        if (kind[g] == 1) {
            IoC::st(cell, p[g].u);
            continue;
        }
        if (moved[g]) {
#if !RESTORE_EARLY_TABLES
            unit_tables<RVEC>(a, tok[g], sub[g], a.neox, cs[g], sn[g]);
#endif
            rotate_unit<Tr, RVEC>(a, cs[g], sn[g], p[g], q[g]);
        }
        IoR::st(cell, p[g].u);
        if (a.neox) IoR::st(cell + half, q[g].u);
    }
}

// Element path (any strides, e.g. the CPU backend's transposed K plane): an item is one pair or one element.
template <class Tr>
__device__ __forceinline__ void slow_token(const Args& a, int t) {
    const long long slot = __ldg(a.slots + t);
    if (slot < 0) return;  // padding token: writes nothing
    const bool moved = __ldg(a.moved + t) != 0;
    using S = typename Tr::S;
    S* dst = static_cast<S*>(a.dst);
    const int LH = a.n_layers * a.n_heads;
    const int half = a.rot / 2;
    const int n_kp = a.dk - a.rot;
    const int items = half + n_kp + a.dv;
    const unsigned s32 = (unsigned)slot;
    const long long b = s32 / (unsigned)a.block_size, n = s32 - (unsigned)b * a.block_size;
    const long long kcell = a.k_off + b * a.k_sB + n * a.k_sN;
    const long long vcell = a.v_off + b * a.v_sB + n * a.v_sN;
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
        for (int r = threadIdx.y; r < LH; r += blockDim.y) {
            const int l = r / a.n_heads, h = r - l * a.n_heads;
            const long long lk = a.layer_base + l;
            const long long srow = (long long)t * LH + r;
            const S* sk = src_row<S>(a, t, l, h, srow, false);
            const long long kb = kcell + lk * a.k_sL + h * a.k_sH;
            if (item < half) {
                const int c1 = a.neox ? a.rot_start + item : a.rot_start + 2 * item;
                const int c2 = a.neox ? c1 + half : c1 + 1;
                S p = sk[c1], q = sk[c2];
                if (moved) {
                    float o1, o2;
                    rotate_pair(Tr::load(p, a.scale), Tr::load(q, a.scale), a.cos_t[(long long)t * half + item],
                                a.sin_t[(long long)t * half + item], o1, o2);
                    p = Tr::store(o1, a.inv_scale);
                    q = Tr::store(o2, a.inv_scale);
                }
                dst[kb + (long long)c1 * a.k_sC] = p;
                dst[kb + (long long)c2 * a.k_sC] = q;
            } else if (item < half + n_kp) {
                const int pch = item - half;
                const int c = pch < a.rot_start ? pch : pch + a.rot;
                dst[kb + (long long)c * a.k_sC] = sk[c];
            } else {
                const int c = item - half - n_kp;
                dst[vcell + lk * a.v_sL + h * a.v_sH + (long long)c * a.v_sC] = src_row<S>(a, t, l, h, srow, true)[c];
            }
        }
    }
}

template <class Tr>
__device__ __forceinline__ void restore_rope_elements(const Args& a) {
    const long long t = (long long)blockIdx.x * blockDim.z + threadIdx.z;
    if (t < a.n_tokens) slow_token<Tr>(a, (int)t);
}

}  // namespace

// Parameters in the order the Python launcher (kmesh.cuda.restore_rope) passes them; each FastDiv is
// three unsigned ints (divisor, magic, shift).
#define RESTORE_ROPE_PARAMS                                                                                 \
    void *dst, const void *src_k, const void *src_v, const long long *slots, const unsigned char *moved,     \
        const float *cos_t, const float *sin_t, long long k_off, long long k_sL, long long k_sB,             \
        long long k_sH, long long k_sN, long long k_sC, long long v_off, long long v_sL, long long v_sB,     \
        long long v_sH, long long v_sN, long long v_sC, int n_tokens, int n_layers, int n_heads, int dk,     \
        int dv, int block_size, int layer_base, int rot_start, int rot, int neox, float scale,               \
        float inv_scale, unsigned units, unsigned rot_units, unsigned kp_units, unsigned tok_d,              \
        unsigned tok_m, unsigned tok_s, unsigned rr_d, unsigned rr_m, unsigned rr_s, unsigned cr_d,          \
        unsigned cr_m, unsigned cr_s, unsigned h_d, unsigned h_m, unsigned h_s, unsigned bs_d, unsigned bs_m, \
        unsigned bs_s, const long long *src_tok, long long sk_L, long long sk_H, long long sv_L, long long sv_H
#define RESTORE_ROPE_ARGS                                                                                   \
    Args{dst,       src_k,     src_v,    slots,    moved,    cos_t,     sin_t,       k_off,     k_sL,         \
         k_sB,      k_sH,      k_sN,     k_sC,     v_off,    v_sL,      v_sB,        v_sH,      v_sN,         \
         v_sC,      n_tokens,  n_layers, n_heads,  dk,       dv,        block_size,  layer_base, rot_start,   \
         rot,       neox,      scale,    inv_scale, units,    rot_units, kp_units,                             \
         FastDiv{tok_d, tok_m, tok_s}, FastDiv{rr_d, rr_m, rr_s}, FastDiv{cr_d, cr_m, cr_s},                  \
         FastDiv{h_d, h_m, h_s}, FastDiv{bs_d, bs_m, bs_s}, src_tok, sk_L, sk_H, sv_L, sv_H}

// Entry points: restore_rope_<type> = vector path, restore_rope_<type>_gather = vector path gathering from a
// paged source (src_tok), restore_rope_<type>_elem = element path, either source (separate kernels so that each
// gets the registers it needs, and the contiguous path pays nothing for the gather).
extern "C" __global__ __launch_bounds__(RESTORE_THREADS, RESTORE_MIN_BLOCKS) void restore_rope_f32(RESTORE_ROPE_PARAMS) {
    fast_units<F32, false>(RESTORE_ROPE_ARGS, blockIdx.x, threadIdx.x);
}
extern "C" __global__ __launch_bounds__(RESTORE_THREADS, RESTORE_MIN_BLOCKS) void restore_rope_f32_gather(RESTORE_ROPE_PARAMS) {
    fast_units<F32, true>(RESTORE_ROPE_ARGS, blockIdx.x, threadIdx.x);
}
extern "C" __global__ __launch_bounds__(256) void restore_rope_f32_elem(RESTORE_ROPE_PARAMS) {
    restore_rope_elements<F32>(RESTORE_ROPE_ARGS);
}
extern "C" __global__ __launch_bounds__(RESTORE_THREADS, RESTORE_MIN_BLOCKS) void restore_rope_f16(RESTORE_ROPE_PARAMS) {
    fast_units<F16, false>(RESTORE_ROPE_ARGS, blockIdx.x, threadIdx.x);
}
extern "C" __global__ __launch_bounds__(RESTORE_THREADS, RESTORE_MIN_BLOCKS) void restore_rope_f16_gather(RESTORE_ROPE_PARAMS) {
    fast_units<F16, true>(RESTORE_ROPE_ARGS, blockIdx.x, threadIdx.x);
}
extern "C" __global__ __launch_bounds__(256) void restore_rope_f16_elem(RESTORE_ROPE_PARAMS) {
    restore_rope_elements<F16>(RESTORE_ROPE_ARGS);
}
extern "C" __global__ __launch_bounds__(RESTORE_THREADS, RESTORE_MIN_BLOCKS) void restore_rope_bf16(RESTORE_ROPE_PARAMS) {
    fast_units<BF16, false>(RESTORE_ROPE_ARGS, blockIdx.x, threadIdx.x);
}
extern "C" __global__ __launch_bounds__(RESTORE_THREADS, RESTORE_MIN_BLOCKS) void restore_rope_bf16_gather(RESTORE_ROPE_PARAMS) {
    fast_units<BF16, true>(RESTORE_ROPE_ARGS, blockIdx.x, threadIdx.x);
}
extern "C" __global__ __launch_bounds__(256) void restore_rope_bf16_elem(RESTORE_ROPE_PARAMS) {
    restore_rope_elements<BF16>(RESTORE_ROPE_ARGS);
}
extern "C" __global__ __launch_bounds__(RESTORE_THREADS, RESTORE_MIN_BLOCKS) void restore_rope_e4m3(RESTORE_ROPE_PARAMS) {
    fast_units<FP8<__NV_E4M3>, false>(RESTORE_ROPE_ARGS, blockIdx.x, threadIdx.x);
}
extern "C" __global__ __launch_bounds__(RESTORE_THREADS, RESTORE_MIN_BLOCKS) void restore_rope_e4m3_gather(RESTORE_ROPE_PARAMS) {
    fast_units<FP8<__NV_E4M3>, true>(RESTORE_ROPE_ARGS, blockIdx.x, threadIdx.x);
}
extern "C" __global__ __launch_bounds__(256) void restore_rope_e4m3_elem(RESTORE_ROPE_PARAMS) {
    restore_rope_elements<FP8<__NV_E4M3>>(RESTORE_ROPE_ARGS);
}
extern "C" __global__ __launch_bounds__(RESTORE_THREADS, RESTORE_MIN_BLOCKS) void restore_rope_e5m2(RESTORE_ROPE_PARAMS) {
    fast_units<FP8<__NV_E5M2>, false>(RESTORE_ROPE_ARGS, blockIdx.x, threadIdx.x);
}
extern "C" __global__ __launch_bounds__(RESTORE_THREADS, RESTORE_MIN_BLOCKS) void restore_rope_e5m2_gather(RESTORE_ROPE_PARAMS) {
    fast_units<FP8<__NV_E5M2>, true>(RESTORE_ROPE_ARGS, blockIdx.x, threadIdx.x);
}
extern "C" __global__ __launch_bounds__(256) void restore_rope_e5m2_elem(RESTORE_ROPE_PARAMS) {
    restore_rope_elements<FP8<__NV_E5M2>>(RESTORE_ROPE_ARGS);
}
