// restore_rope: write a saved KV segment into paged-cache slots, rotating keys to their new positions.
//
// One kernel (restore_rope_body) instantiated for five storage types; the extern "C" entry points are
// restore_rope_{f32,f16,bf16,e4m3,e5m2}. Semantics are kmesh.restore's torch path, bit for bit:
//   moved token, rotary channel pair (x1, x2) with tables (c, s) of (new - old)·ω (float32, from float64):
//     o1 = x1·c − x2·s,  o2 = x2·c + x1·s   (float32, each product and sum rounded: no FMA contraction)
//     result cast to the storage type by round-to-nearest-even (fp8: x = fp8·scale before, fp8(o·inv_scale)
//     saturated to the largest finite value after);
//   everything else (values, non-rotary key channels, keys of tokens that do not move) copied as bits.
//
// Memory layout
//   src_k [T, L, H, Dk] and src_v [T, L, H, Dv], contiguous, storage type S (uint8 for fp8).
//   cos, sin [T, rot/2] float32; slots [T] int64 (−1 = padding, skipped); moved [T] uint8.
//   dst: flat cache of S. K element (layer l, block b, head h, token-in-block n, channel c) at
//     k_off + (layer_base + l)·k_sL + b·k_sB + h·k_sH + n·k_sN + c·k_sC   (V likewise with v_*),
//   b = slot / block_size, n = slot % block_size. This covers every arrangement kmesh.layout knows:
//   paged [K|V] cells in any of the six orders (k_sC = 1), vLLM CPU planes (K transposed: k_sN = 1,
//   k_sC = block_size) and MLA latents (rotary part at channels [rot_start, rot_start + rot)).
//
// Work split: one row = one (token, layer, head); a row's channels are split into items: rotary items,
// plain-key items, value items. Fast path (all channel strides 1, widths and offsets multiples of
// VEC = chunk / sizeof(S), chunk-aligned pointers; chunk = 16 bytes, fp8 RESTORE_FP8_CHUNK): an item is VEC
// channels moved with one vector load and store per chunk (neox: VEC pairs = one chunk at c and one at
// c + rot/2; gptj: one chunk = VEC/2 adjacent pairs).
// Element path: an item is one pair or one element, any strides.
// Launch: one block z-slice per token (its slot, flag and shift tables are read once per thread, not per
// row); block (bx, by, bz): bx = items per row (<= 256), by threads walk the token's L·H rows (fast path:
// U = RESTORE_U rows per step, all their loads issued before the stores), bz tokens per block;
// grid.x = ceil(T / bz). Threads per block <= 256. H200 measurements: docs/measurements/restore_h200.md.
//
// Bytes: reads T·L·H·(Dk + Dv)·sizeof(S) of segment + T·rot/2·8 of tables + 9·T of slots/flags;
// writes the same T·L·H·(Dk + Dv)·sizeof(S) into the cache (padding tokens: nothing).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// Tunables (compile-time; the defaults are what the kernels stage builds; kmesh.cuda reads the same -D
// flags to size its launch): rows whose loads one thread issues before storing, the chunk size of fp8
// caches in bytes (16 or 8), and packed two-at-a-time fp8 conversions (same results, fewer instructions).
#ifndef RESTORE_U
#define RESTORE_U 4
#endif
#ifndef RESTORE_FP8_CHUNK
#define RESTORE_FP8_CHUNK 16
#endif
#ifndef RESTORE_FP8_X2
#define RESTORE_FP8_X2 0
#endif

namespace {

// Storage traits: element <-> float32 (fp8: ×scale after decoding, ×inv_scale before encoding), singly
// and for two adjacent elements (packed instructions where the format has them).
template <class Self, class S_>
struct Scalar2 {
    __device__ static float2 load2(S_ a, S_ b, float scale) { return make_float2(Self::load(a, scale), Self::load(b, scale)); }
    __device__ static void store2(float x, float y, float inv, S_& a, S_& b) { a = Self::store(x, inv); b = Self::store(y, inv); }
};
struct F32 : Scalar2<F32, float> {
    using S = float;
    static constexpr int CHUNK = 16;
    __device__ static float load(S v, float) { return v; }
    __device__ static S store(float x, float) { return x; }
};
struct F16 : Scalar2<F16, __half> {
    using S = __half;
    static constexpr int CHUNK = 16;
    __device__ static float load(S v, float) { return __half2float(v); }
    __device__ static S store(float x, float) { return __float2half_rn(x); }
};
struct BF16 : Scalar2<BF16, __nv_bfloat16> {
    using S = __nv_bfloat16;
    static constexpr int CHUNK = 16;
    __device__ static float load(S v, float) { return __bfloat162float(v); }
    __device__ static S store(float x, float) { return __float2bfloat16_rn(x); }
};
template <__nv_fp8_interpretation_t KIND>
struct FP8 {
    using S = unsigned char;
    static constexpr int CHUNK = RESTORE_FP8_CHUNK;
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
    int n_tokens, n_layers, n_heads, dk, dv, block_size, layer_base, rot_start, rot, neox, fast;
    float scale, inv_scale;
};

__device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float s, float& o1, float& o2) {
    o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

template <int BYTES> struct VecOf;
template <> struct VecOf<16> { using T = uint4; };
template <> struct VecOf<8> { using T = uint2; };
template <class S, int BYTES>
struct Chunk {
    static constexpr int VEC = BYTES / sizeof(S);
    using V = typename VecOf<BYTES>::T;
    union { V u; S e[VEC]; };
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

// Fast path: one CUDA block z-slice per token; thread x = one chunk of every row, thread y walks the token's
// L·H rows U at a time. Everything a thread loads (slot, flag, tables, its first U rows) is requested before
// anything waits on the slot, so a thread pays about one memory latency, not three.
template <class Tr>
__device__ __forceinline__ void fast_token(const Args& a, int t) {
    using S = typename Tr::S;
    using C = Chunk<S, Tr::CHUNK>;
    using V = typename C::V;
    constexpr int VEC = C::VEC;
    constexpr int U = RESTORE_U;
    S* dst = static_cast<S*>(a.dst);
    const long long slot = __ldg(a.slots + t);
    const bool moved = __ldg(a.moved + t) != 0;
    const int LH = a.n_layers * a.n_heads;
    const int half = a.rot / 2;
    const int n_rot = a.neox ? half / VEC : a.rot / VEC;
    const int n_kp = (a.dk - a.rot) / VEC;
    const int items = n_rot + n_kp + a.dv / VEC;
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
        // what this item moves: 0 = rotary chunk(s), 1 = plain key chunk, 2 = value chunk
        const int kind = item < n_rot ? 0 : (item < n_rot + n_kp ? 1 : 2);
        int c1, c2 = 0;
        float cs[VEC], sn[VEC];
        if (kind == 0) {
            c1 = a.rot_start + item * VEC;
            const float* ct = a.cos_t + (long long)t * half;
            const float* st = a.sin_t + (long long)t * half;
            if (a.neox) {
                c2 = c1 + half;
                load_table<VEC>(ct + item * VEC, cs);
                load_table<VEC>(st + item * VEC, sn);
            } else {
                load_table<VEC / 2>(ct + item * VEC / 2, cs);
                load_table<VEC / 2>(st + item * VEC / 2, sn);
            }
        } else if (kind == 1) {
            const int pch = (item - n_rot) * VEC;
            c1 = pch < a.rot_start ? pch : pch + a.rot;
        } else {
            c1 = (item - n_rot - n_kp) * VEC;
        }
        const bool pairs2 = kind == 0 && a.neox;          // two chunks (c1, c2) per row
        const S* src = kind == 2 ? static_cast<const S*>(a.src_v) : static_cast<const S*>(a.src_k);
        const int sd = kind == 2 ? a.dv : a.dk;
        for (int r0 = threadIdx.y; r0 < LH; r0 += blockDim.y * U) {
            C p[U], q[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int r = r0 + u * blockDim.y;
                if (r < LH) {
                    const S* row = src + ((long long)t * LH + r) * sd;
                    p[u].u = __ldg(reinterpret_cast<const V*>(row + c1));
                    if (pairs2) q[u].u = __ldg(reinterpret_cast<const V*>(row + c2));
                }
            }
            if (slot < 0) return;  // padding token: writes nothing
            const unsigned s32 = (unsigned)slot;  // host checks num_slots < 2^31
            const long long b = s32 / (unsigned)a.block_size, n = s32 - (unsigned)b * a.block_size;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int r = r0 + u * blockDim.y;
                if (r >= LH) continue;
                const int l = r / a.n_heads, h = r - l * a.n_heads;
                const long long lk = a.layer_base + l;
                if (kind == 2) {
                    *reinterpret_cast<V*>(dst + a.v_off + lk * a.v_sL + b * a.v_sB + h * a.v_sH + n * a.v_sN + c1) =
                        p[u].u;
                    continue;
                }
                if (kind == 0 && moved) {
                    if (a.neox) {
#pragma unroll
                        for (int j = 0; j < VEC; j += 2) {
                            const float2 x1 = Tr::load2(p[u].e[j], p[u].e[j + 1], a.scale);
                            const float2 x2 = Tr::load2(q[u].e[j], q[u].e[j + 1], a.scale);
                            float o1a, o2a, o1b, o2b;
                            rotate_pair(x1.x, x2.x, cs[j], sn[j], o1a, o2a);
                            rotate_pair(x1.y, x2.y, cs[j + 1], sn[j + 1], o1b, o2b);
                            Tr::store2(o1a, o1b, a.inv_scale, p[u].e[j], p[u].e[j + 1]);
                            Tr::store2(o2a, o2b, a.inv_scale, q[u].e[j], q[u].e[j + 1]);
                        }
                    } else {
#pragma unroll
                        for (int j = 0; j < VEC / 2; ++j) {
                            const float2 x = Tr::load2(p[u].e[2 * j], p[u].e[2 * j + 1], a.scale);
                            float o1, o2;
                            rotate_pair(x.x, x.y, cs[j], sn[j], o1, o2);
                            Tr::store2(o1, o2, a.inv_scale, p[u].e[2 * j], p[u].e[2 * j + 1]);
                        }
                    }
                }
                const long long kb = a.k_off + lk * a.k_sL + b * a.k_sB + h * a.k_sH + n * a.k_sN;
                *reinterpret_cast<V*>(dst + kb + c1) = p[u].u;
                if (pairs2) *reinterpret_cast<V*>(dst + kb + c2) = q[u].u;
            }
        }
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
    const S* sk = static_cast<const S*>(a.src_k);
    const S* sv = static_cast<const S*>(a.src_v);
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
            const long long kb = kcell + lk * a.k_sL + h * a.k_sH;
            if (item < half) {
                const int c1 = a.neox ? a.rot_start + item : a.rot_start + 2 * item;
                const int c2 = a.neox ? c1 + half : c1 + 1;
                S p = sk[srow * a.dk + c1], q = sk[srow * a.dk + c2];
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
                dst[kb + (long long)c * a.k_sC] = sk[srow * a.dk + c];
            } else {
                const int c = item - half - n_kp;
                dst[vcell + lk * a.v_sL + h * a.v_sH + (long long)c * a.v_sC] = sv[srow * a.dv + c];
            }
        }
    }
}

template <class Tr>
__device__ __forceinline__ void restore_rope_body(const Args& a) {
    const long long t = (long long)blockIdx.x * blockDim.z + threadIdx.z;
    if (t >= a.n_tokens) return;
    if (a.fast) fast_token<Tr>(a, (int)t);
    else slow_token<Tr>(a, (int)t);
}

}  // namespace

// Parameters in the order the Python launcher (kmesh.cuda.restore_rope) passes them.
#define RESTORE_ROPE_PARAMS                                                                                 \
    void *dst, const void *src_k, const void *src_v, const long long *slots, const unsigned char *moved,     \
        const float *cos_t, const float *sin_t, long long k_off, long long k_sL, long long k_sB,             \
        long long k_sH, long long k_sN, long long k_sC, long long v_off, long long v_sL, long long v_sB,     \
        long long v_sH, long long v_sN, long long v_sC, int n_tokens, int n_layers, int n_heads, int dk,     \
        int dv, int block_size, int layer_base, int rot_start, int rot, int neox, int fast, float scale,     \
        float inv_scale
#define RESTORE_ROPE_ARGS                                                                                   \
    Args{dst,  src_k, src_v, slots, moved, cos_t, sin_t, k_off, k_sL, k_sB, k_sH, k_sN,                     \
         k_sC, v_off, v_sL, v_sB, v_sH, v_sN, v_sC, n_tokens, n_layers, n_heads, dk, dv,                    \
         block_size, layer_base, rot_start, rot, neox, fast, scale, inv_scale}

extern "C" __global__ void restore_rope_f32(RESTORE_ROPE_PARAMS) { restore_rope_body<F32>(RESTORE_ROPE_ARGS); }
extern "C" __global__ void restore_rope_f16(RESTORE_ROPE_PARAMS) { restore_rope_body<F16>(RESTORE_ROPE_ARGS); }
extern "C" __global__ void restore_rope_bf16(RESTORE_ROPE_PARAMS) { restore_rope_body<BF16>(RESTORE_ROPE_ARGS); }
extern "C" __global__ void restore_rope_e4m3(RESTORE_ROPE_PARAMS) {
    restore_rope_body<FP8<__NV_E4M3>>(RESTORE_ROPE_ARGS);
}
extern "C" __global__ void restore_rope_e5m2(RESTORE_ROPE_PARAMS) {
    restore_rope_body<FP8<__NV_E5M2>>(RESTORE_ROPE_ARGS);
}
