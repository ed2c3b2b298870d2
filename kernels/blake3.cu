// blake3: the standard BLAKE3 hash (32-byte output, no key), computed as its specification's tree: 1 KiB chunks
// hash in parallel (one thread per chunk: up to 16 compressions of 64-byte blocks, chunk counter = chunk index,
// CHUNK_START / CHUNK_END flags), then parent levels (PARENT; the last compression of the whole object also ROOT).
// The digest equals the `blake3` PyPI package's for every length (tests/test_integrity_kernels.py, GPU tests).
// Tree shape and passes: kernels/integrity_tree.cuh (8 levels per launch in shared memory).
//
// Memory layout: ptrs[n_obj] (uint64 device addresses), lens[n_obj] (bytes); a chunk's full 64-byte blocks are read
// as 4 × 16-byte vectors when its address is 16-byte aligned, as 32-bit words when 4-byte aligned, else by bytes
// (the partial last block always by bytes, zero-padded). Nodes: 8 uint32 chaining-value words (little-endian
// bytes = the digest). blk0 / prev_blk0: per-pass block prefix sums.
// Bytes: the chunk pass reads every object byte once and writes 32 bytes per block; a parent pass reads 32 bytes
// per input node. Launch: grid.x = blk0[n_obj], block TREE_THREADS = 256, 16 KiB static shared memory.
#include <stdint.h>
#include "integrity_tree.cuh"

#define B3_CHUNK_START 1u
#define B3_CHUNK_END 2u
#define B3_PARENT 4u
#define B3_ROOT 8u
#define B3_CHUNK_LEN 1024u

#ifdef __CUDA_ARCH__
#define B3_ROTR(x, n) __funnelshift_r((x), (x), (n))
#else
#define B3_ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
#endif

#define B3_IV0 0x6A09E667u
#define B3_IV1 0xBB67AE85u
#define B3_IV2 0x3C6EF372u
#define B3_IV3 0xA54FF53Au
#define B3_IV4 0x510E527Fu
#define B3_IV5 0x9B05688Cu
#define B3_IV6 0x1F83D9ABu
#define B3_IV7 0x5BE0CD19u

__host__ __device__ inline void km_b3_prefetch(const uint8_t* p, uint32_t n) {
#ifdef __CUDA_ARCH__
    for (uint32_t o = 0; o < n; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
#else
    (void)p; (void)n;
#endif
}

__host__ __device__ inline void b3_iv(uint32_t cv[8]) {
    cv[0] = B3_IV0; cv[1] = B3_IV1; cv[2] = B3_IV2; cv[3] = B3_IV3;
    cv[4] = B3_IV4; cv[5] = B3_IV5; cv[6] = B3_IV6; cv[7] = B3_IV7;
}

#define B3_G(a, b, c, d, x, y)                         \
    do {                                               \
        a = a + b + (x); d = B3_ROTR(d ^ a, 16);       \
        c = c + d;       b = B3_ROTR(b ^ c, 12);       \
        a = a + b + (y); d = B3_ROTR(d ^ a, 8);        \
        c = c + d;       b = B3_ROTR(b ^ c, 7);        \
    } while (0)

// The message word order of round r (the specification's permutation applied r times); indices are
// compile-time constants after unrolling, so m stays in registers.
#define B3_ROUND(r)                                                                       \
    do {                                                                                  \
        B3_G(s0, s4, s8, s12, m[S[r][0]], m[S[r][1]]);                                    \
        B3_G(s1, s5, s9, s13, m[S[r][2]], m[S[r][3]]);                                    \
        B3_G(s2, s6, s10, s14, m[S[r][4]], m[S[r][5]]);                                   \
        B3_G(s3, s7, s11, s15, m[S[r][6]], m[S[r][7]]);                                   \
        B3_G(s0, s5, s10, s15, m[S[r][8]], m[S[r][9]]);                                   \
        B3_G(s1, s6, s11, s12, m[S[r][10]], m[S[r][11]]);                                 \
        B3_G(s2, s7, s8, s13, m[S[r][12]], m[S[r][13]]);                                  \
        B3_G(s3, s4, s9, s14, m[S[r][14]], m[S[r][15]]);                                  \
    } while (0)

// Compress one block into cv (the chaining value = first 8 output words; for the ROOT block: the digest).
__host__ __device__ inline void b3_compress(uint32_t cv[8], const uint32_t m[16], uint64_t counter,
                                            uint32_t block_len, uint32_t flags) {
    constexpr uint8_t S[7][16] = {
        {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
        {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
        {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1},
        {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
        {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4},
        {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
        {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13}};
    uint32_t s0 = cv[0], s1 = cv[1], s2 = cv[2], s3 = cv[3], s4 = cv[4], s5 = cv[5], s6 = cv[6], s7 = cv[7];
    uint32_t s8 = B3_IV0, s9 = B3_IV1, s10 = B3_IV2, s11 = B3_IV3;
    uint32_t s12 = (uint32_t)counter, s13 = (uint32_t)(counter >> 32), s14 = block_len, s15 = flags;
    B3_ROUND(0); B3_ROUND(1); B3_ROUND(2); B3_ROUND(3); B3_ROUND(4); B3_ROUND(5); B3_ROUND(6);
    cv[0] = s0 ^ s8; cv[1] = s1 ^ s9; cv[2] = s2 ^ s10; cv[3] = s3 ^ s11;
    cv[4] = s4 ^ s12; cv[5] = s5 ^ s13; cv[6] = s6 ^ s14; cv[7] = s7 ^ s15;
}

// Block words of p[0:n], n <= 64, zero-padded, little-endian.
__host__ __device__ inline void b3_load_block(uint32_t m[16], const uint8_t* p, uint32_t n) {
    uintptr_t a = (uintptr_t)p;
    if (n == 64 && (a & 15) == 0) {
        const uint4* v = (const uint4*)p;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint4 x = v[i];
            m[4 * i] = x.x; m[4 * i + 1] = x.y; m[4 * i + 2] = x.z; m[4 * i + 3] = x.w;
        }
    } else if (n == 64 && (a & 3) == 0) {
        const uint32_t* w = (const uint32_t*)p;
#pragma unroll
        for (int i = 0; i < 16; ++i) m[i] = w[i];
    } else {
        for (int i = 0; i < 16; ++i) {
            uint32_t x = 0;
            for (int k = 3; k >= 0; --k) {
                uint32_t j = 4 * i + k;
                x = (x << 8) | (j < n ? p[j] : 0u);
            }
            m[i] = x;
        }
    }
}

// Chaining value of chunk `idx` of an object of `len` bytes (root: the object is this one chunk).
__host__ __device__ inline void b3_chunk(uint32_t cv[8], const uint8_t* data, uint64_t len, uint64_t idx, bool root) {
    uint64_t off = idx * B3_CHUNK_LEN;
    uint32_t n = (uint32_t)(len - off < B3_CHUNK_LEN ? len - off : B3_CHUNK_LEN);
    uint32_t blocks = n == 0 ? 1 : (n + 63) / 64;
    b3_iv(cv);
    uint32_t m[16];
    const uint8_t* p = data + off;
    if (n == B3_CHUNK_LEN && ((uintptr_t)p & 15) == 0) {
        // full aligned chunk: the whole KiB requested from L2 up front, then each block's 16-byte loads issued one
        // compression ahead (double buffer), so a thread's 16 chained compressions do not wait on memory
        km_b3_prefetch(p, B3_CHUNK_LEN);
        uint32_t nx[16];
        b3_load_block(m, p, 64);
#pragma unroll 1
        for (uint32_t i = 0; i < 16; ++i) {
            if (i + 1 < 16) b3_load_block(nx, p + 64 * (i + 1), 64);
            uint32_t flags = (i == 0 ? B3_CHUNK_START : 0u) | (i == 15 ? B3_CHUNK_END | (root ? B3_ROOT : 0u) : 0u);
            b3_compress(cv, m, idx, 64, flags);
#pragma unroll
            for (int k = 0; k < 16; ++k) m[k] = nx[k];
        }
        return;
    }
    for (uint32_t i = 0; i < blocks; ++i) {
        uint32_t bl = n - 64 * i < 64 ? n - 64 * i : 64;   // n == 0: one empty block
        b3_load_block(m, data + off + 64 * i, bl);
        uint32_t flags = (i == 0 ? B3_CHUNK_START : 0u) | (i + 1 == blocks ? B3_CHUNK_END | (root ? B3_ROOT : 0u) : 0u);
        b3_compress(cv, m, idx, bl, flags);
    }
}

__host__ __device__ inline void b3_parent(const uint32_t* l, const uint32_t* r, bool root, uint32_t* out) {
    uint32_t m[16];
    for (int i = 0; i < 8; ++i) { m[i] = l[i]; m[8 + i] = r[i]; }
    b3_iv(out);
    b3_compress(out, m, 0, 64, B3_PARENT | (root ? B3_ROOT : 0u));
}

struct Blake3Chunks {
    const uint64_t* ptrs;
    const uint64_t* lens;
    __host__ __device__ uint32_t inputs(int o) const {
        uint64_t n = (lens[o] + B3_CHUNK_LEN - 1) / B3_CHUNK_LEN;
        return n == 0 ? 1u : (uint32_t)n;
    }
    __host__ __device__ void leaf(const TreeBlock& tb, uint64_t idx, uint32_t* out) const {
        b3_chunk(out, (const uint8_t*)(uintptr_t)ptrs[tb.obj], lens[tb.obj], idx, tb.n_in == 1);
    }
    __host__ __device__ void node(const uint32_t* l, const uint32_t* r, bool root, uint32_t* out) const {
        b3_parent(l, r, root, out);
    }
};

struct Blake3Parents {
    TreePassInput src;
    __host__ __device__ uint32_t inputs(int o) const { return src.inputs(o); }
    __host__ __device__ void leaf(const TreeBlock& tb, uint64_t idx, uint32_t* out) const { src.load(tb, idx, out); }
    __host__ __device__ void node(const uint32_t* l, const uint32_t* r, bool root, uint32_t* out) const {
        b3_parent(l, r, root, out);
    }
};

extern "C" __global__ __launch_bounds__(TREE_THREADS) void
blake3_chunks(const uint64_t* ptrs, const uint64_t* lens, const uint32_t* blk0, int n_obj, uint32_t* out) {
    Blake3Chunks h{ptrs, lens};
    tree_block_run(h, blk0, n_obj, out);
}

extern "C" __global__ __launch_bounds__(TREE_THREADS) void
blake3_parents(const uint32_t* in, const uint32_t* prev_blk0, const uint32_t* blk0, int n_obj, uint32_t* out) {
    Blake3Parents h{{in, prev_blk0}};
    tree_block_run(h, blk0, n_obj, out);
}

// One launch per request (integrity_tree.cuh, tree_set_run): every chunk, every parent level and each object's ROOT
// in one grid of tables[0][n_obj] blocks of N threads. tables: passes × (n_obj + 1) block prefix sums of N nodes per
// block; nodes: Σ blocks × 8 words of scratch; counters: Σ_{p≥1} blocks, zeroed (left zeroed); digests: n_obj × 8
// words (may be mapped pinned host memory). N = 64 / 128 / 256: kmesh.integrity.gpu.SET_THREADS picks one; all three
// are timed by `kmesh diagnose gpu_hash_overhead`.
extern "C" __global__ __launch_bounds__(64) void
blake3_set_64(const uint64_t* ptrs, const uint64_t* lens, const uint32_t* tables, int passes, int n_obj,
              uint32_t* nodes, uint32_t* counters, uint32_t* digests) {
    tree_set_run<64>(Blake3Chunks{ptrs, lens}, TreeSetTables{tables, passes, n_obj}, nodes, counters, digests);
}
extern "C" __global__ __launch_bounds__(128) void
blake3_set_128(const uint64_t* ptrs, const uint64_t* lens, const uint32_t* tables, int passes, int n_obj,
              uint32_t* nodes, uint32_t* counters, uint32_t* digests) {
    tree_set_run<128>(Blake3Chunks{ptrs, lens}, TreeSetTables{tables, passes, n_obj}, nodes, counters, digests);
}
extern "C" __global__ __launch_bounds__(256) void
blake3_set_256(const uint64_t* ptrs, const uint64_t* lens, const uint32_t* tables, int passes, int n_obj,
              uint32_t* nodes, uint32_t* counters, uint32_t* digests) {
    tree_set_run<256>(Blake3Chunks{ptrs, lens}, TreeSetTables{tables, passes, n_obj}, nodes, counters, digests);
}
