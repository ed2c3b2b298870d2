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
// Work split: one row = one (token, layer, head). A row has items: rotary items, plain-key items, value
// items. Fast path (all channel strides 1, widths and offsets multiples of VEC = 16 / sizeof(S), 16-byte
// aligned pointers): an item is VEC channels moved with 16-byte loads/stores (neox: VEC pairs = one
// 16-byte chunk at c and one at c + rot/2; gptj: one chunk = VEC/2 adjacent pairs). Slow path: an item is
// one pair or one element, any strides.
// Launch: block (bx, by) with bx = min(items per row, 256) threads over a row's items and by = 256 / bx
// rows per block; grid.x = ceil(rows / by). Rows = T·L·H must fit in int32 (checked by the host).
//
// Bytes: reads T·L·H·(Dk + Dv)·sizeof(S) of segment + T·rot/2·8 of tables + 9·T of slots/flags;
// writes the same T·L·H·(Dk + Dv)·sizeof(S) into the cache (padding tokens: nothing).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

struct F32 {
    using S = float;
    __device__ static float load(S v, float) { return v; }
    __device__ static S store(float x, float) { return x; }
};
struct F16 {
    using S = __half;
    __device__ static float load(S v, float) { return __half2float(v); }
    __device__ static S store(float x, float) { return __float2half_rn(x); }
};
struct BF16 {
    using S = __nv_bfloat16;
    __device__ static float load(S v, float) { return __bfloat162float(v); }
    __device__ static S store(float x, float) { return __float2bfloat16_rn(x); }
};
template <__nv_fp8_interpretation_t KIND>
struct FP8 {
    using S = unsigned char;
    __device__ static float load(S v, float scale) {
        __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), KIND);
        return __fmul_rn(__half2float(__half(h)), scale);
    }
    __device__ static S store(float x, float inv_scale) {
        return static_cast<S>(__nv_cvt_float_to_fp8(__fmul_rn(x, inv_scale), __NV_SATFINITE, KIND));
    }
};

struct Args {
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

template <class Tr>
__device__ __forceinline__ void fast_row(const Args& a, int item, int t, long long src_row,
                                         long long kdst, long long vdst, bool moved) {
    using S = typename Tr::S;
    constexpr int VEC = 16 / sizeof(S);
    union Chunk { uint4 u; S e[VEC]; };
    S* dst = static_cast<S*>(a.dst);
    const S* sk = static_cast<const S*>(a.src_k) + src_row * a.dk;
    const int half = a.rot / 2;
    const int n_rot = a.neox ? half / VEC : a.rot / VEC;
    const int n_kp = (a.dk - a.rot) / VEC;
    if (item < n_rot) {
        if (a.neox) {
            const int c1 = a.rot_start + item * VEC, c2 = c1 + half;
            Chunk p, q;
            p.u = __ldg(reinterpret_cast<const uint4*>(sk + c1));
            q.u = __ldg(reinterpret_cast<const uint4*>(sk + c2));
            if (moved) {
                const float* cs = a.cos_t + (long long)t * half + item * VEC;
                const float* sn = a.sin_t + (long long)t * half + item * VEC;
#pragma unroll
                for (int j = 0; j < VEC; j += 4) {
                    const float4 c4 = __ldg(reinterpret_cast<const float4*>(cs + j));
                    const float4 s4 = __ldg(reinterpret_cast<const float4*>(sn + j));
                    const float cc[4] = {c4.x, c4.y, c4.z, c4.w}, ss[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        float o1, o2;
                        rotate_pair(Tr::load(p.e[j + u], a.scale), Tr::load(q.e[j + u], a.scale), cc[u], ss[u], o1, o2);
                        p.e[j + u] = Tr::store(o1, a.inv_scale);
                        q.e[j + u] = Tr::store(o2, a.inv_scale);
                    }
                }
            }
            *reinterpret_cast<uint4*>(dst + kdst + c1) = p.u;
            *reinterpret_cast<uint4*>(dst + kdst + c2) = q.u;
        } else {
            const int c = a.rot_start + item * VEC;
            Chunk p;
            p.u = __ldg(reinterpret_cast<const uint4*>(sk + c));
            if (moved) {
                const int pair0 = item * VEC / 2;
#pragma unroll
                for (int j = 0; j < VEC / 2; ++j) {
                    const float cc = __ldg(a.cos_t + (long long)t * half + pair0 + j);
                    const float ss = __ldg(a.sin_t + (long long)t * half + pair0 + j);
                    float o1, o2;
                    rotate_pair(Tr::load(p.e[2 * j], a.scale), Tr::load(p.e[2 * j + 1], a.scale), cc, ss, o1, o2);
                    p.e[2 * j] = Tr::store(o1, a.inv_scale);
                    p.e[2 * j + 1] = Tr::store(o2, a.inv_scale);
                }
            }
            *reinterpret_cast<uint4*>(dst + kdst + c) = p.u;
        }
    } else if (item < n_rot + n_kp) {
        const int pch = (item - n_rot) * VEC;
        const int c = pch < a.rot_start ? pch : pch + a.rot;
        *reinterpret_cast<uint4*>(dst + kdst + c) = __ldg(reinterpret_cast<const uint4*>(sk + c));
    } else {
        const int c = (item - n_rot - n_kp) * VEC;
        const S* sv = static_cast<const S*>(a.src_v) + src_row * a.dv;
        *reinterpret_cast<uint4*>(dst + vdst + c) = __ldg(reinterpret_cast<const uint4*>(sv + c));
    }
}

template <class Tr>
__device__ __forceinline__ void slow_row(const Args& a, int item, int t, long long src_row,
                                         long long kdst, long long vdst, bool moved) {
    using S = typename Tr::S;
    S* dst = static_cast<S*>(a.dst);
    const S* sk = static_cast<const S*>(a.src_k) + src_row * a.dk;
    const int half = a.rot / 2;
    const int n_kp = a.dk - a.rot;
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
        dst[kdst + (long long)c1 * a.k_sC] = p;
        dst[kdst + (long long)c2 * a.k_sC] = q;
    } else if (item < half + n_kp) {
        const int pch = item - half;
        const int c = pch < a.rot_start ? pch : pch + a.rot;
        dst[kdst + (long long)c * a.k_sC] = sk[c];
    } else {
        const int c = item - half - n_kp;
        const S* sv = static_cast<const S*>(a.src_v) + src_row * a.dv;
        dst[vdst + (long long)c * a.v_sC] = sv[c];
    }
}

template <class Tr>
__device__ __forceinline__ void restore_rope_body(const Args& a) {
    constexpr int VEC = 16 / sizeof(typename Tr::S);
    const int items = a.fast ? (a.neox ? a.rot / 2 / VEC : a.rot / VEC) + (a.dk - a.rot) / VEC + a.dv / VEC
                             : a.rot / 2 + (a.dk - a.rot) + a.dv;
    const unsigned rows = (unsigned)a.n_tokens * a.n_layers * a.n_heads;
    const unsigned row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    const unsigned lh = (unsigned)a.n_layers * a.n_heads;
    const int t = row / lh;
    const unsigned rem = row - (unsigned)t * lh;
    const int l = rem / a.n_heads;
    const int h = rem - (unsigned)l * a.n_heads;
    const long long slot = __ldg(a.slots + t);
    if (slot < 0) return;
    const unsigned s32 = (unsigned)slot;  // host checks num_slots < 2^31
    const long long b = s32 / (unsigned)a.block_size, n = s32 - (unsigned)b * a.block_size;
    const long long lk = a.layer_base + l;
    const long long kdst = a.k_off + lk * a.k_sL + b * a.k_sB + h * a.k_sH + n * a.k_sN;
    const long long vdst = a.v_off + lk * a.v_sL + b * a.v_sB + h * a.v_sH + n * a.v_sN;
    const bool moved = __ldg(a.moved + t) != 0;
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
        if (a.fast) fast_row<Tr>(a, item, t, row, kdst, vdst, moved);
        else slow_row<Tr>(a, item, t, row, kdst, vdst, moved);
    }
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
