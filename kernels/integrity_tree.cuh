// integrity_tree.cuh: the tree-reduction skeleton shared by kernels/sha256_tree.cu and kernels/blake3.cu.
//
// Both formats hash leaves (sha256-tree chunks / BLAKE3 1 KiB chunks) into 8-word nodes and combine the nodes of a
// level pairwise from the left; an odd last node is carried up unchanged (RFC 6962's "largest power of two"
// split and BLAKE3's "left subtree = largest power of two chunks < n" give exactly this tree).
//
// Launch (one per pass, all objects at once): TREE_THREADS threads per block; block b belongs to the object o with
// blk0[o] <= b < blk0[o+1] (blk0: n_obj + 1 prefix sums, per pass) and covers that object's input nodes
// [bo·256, bo·256 + 256), bo = b − blk0[o]. Each thread makes one input node (a leaf from the data, or a node of
// the previous pass from global memory), then the block folds TREE_LEVELS = 8 levels in shared memory (ping-pong
// buffers, a barrier per level) and writes its one level-8 node to out[b]. An object with ≤ 256 input nodes thus
// ends a pass with its root at out[blk0[o]]; larger objects take further passes over out (host: kmesh.integrity
// .gpu plans them). Every level uses the object's GLOBAL node count, so promotion of an odd last node and the
// root test (BLAKE3 ROOT flag: the one parent of a level of 2) are exact across block boundaries.
//
// Phases are __host__ __device__ functions; the __global__ wrappers only sequence them with barriers, and
// tests/integrity_host/harness.cu sequences the same phases on the CPU.
#pragma once
#include <stdint.h>

#define TREE_THREADS 256
#define TREE_LEVELS 8

struct TreeBlock {
    int obj;        // object index
    uint32_t bo;    // block index within the object for this pass
    uint32_t n_in;  // the object's input nodes in this pass (leaves or previous-pass nodes)
};

// Which object block b serves (binary search over blk0[0..n_obj]).
__host__ __device__ inline int tree_object_of(const uint32_t* blk0, int n_obj, uint32_t b) {
    int lo = 0, hi = n_obj - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (blk0[mid] <= b) lo = mid; else hi = mid - 1;
    }
    return lo;
}

__host__ __device__ inline void tree_copy8(uint32_t* dst, const uint32_t* src) {
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = src[i];
}

// Level `l` (1..TREE_LEVELS) of a block: thread t makes node t of this block's level-l nodes from src[2t], src[2t+1]
// (level l − 1). n_prev: the object's global node count at level l − 1. H::node(l, r, root, out).
// `threads`: the block's input nodes (TREE_THREADS for the per-pass kernels; the one-launch kernels choose theirs).
template <class H>
__host__ __device__ inline void tree_level(const H& h, const TreeBlock& tb, uint32_t n_prev, int l, int t,
                                           uint32_t (*src)[8], uint32_t (*dst)[8], uint32_t threads = TREE_THREADS) {
    uint32_t width = threads >> l;
    if ((uint32_t)t >= width) return;
    uint64_t j = (uint64_t)tb.bo * width + t;
    uint64_t m = (n_prev + 1) / 2;
    if (j >= m) return;
    if (2 * j + 1 < n_prev) h.node(src[2 * t], src[2 * t + 1], n_prev == 2, dst[t]);
    else tree_copy8(dst[t], src[2 * t]);
}

// Global node count of level l given n_in at level 0.
__host__ __device__ inline uint32_t tree_count_at(uint32_t n_in, int l) {
    uint32_t n = n_in;
    for (int i = 0; i < l; ++i) n = (n + 1) / 2;
    return n;
}

#ifdef __CUDACC__
// The device sequence: leaf phase, TREE_LEVELS folded levels, one store. H::leaf(tb, idx, out) makes input node idx.
template <class H>
__device__ inline void tree_block_run(const H& h, const uint32_t* blk0, int n_obj, uint32_t* out) {
    __shared__ uint32_t buf[2][TREE_THREADS][8];
    uint32_t b = blockIdx.x;
    int t = threadIdx.x;
    TreeBlock tb;
    tb.obj = tree_object_of(blk0, n_obj, b);
    tb.bo = b - blk0[tb.obj];
    tb.n_in = h.inputs(tb.obj);
    uint64_t idx = (uint64_t)tb.bo * TREE_THREADS + t;
    if (idx < tb.n_in) h.leaf(tb, idx, buf[0][t]);
    __syncthreads();
    uint32_t n = tb.n_in;
    for (int l = 1; l <= TREE_LEVELS; ++l) {
        tree_level(h, tb, n, l, t, buf[(l - 1) & 1], buf[l & 1]);
        n = (n + 1) / 2;
        __syncthreads();
    }
    if (t < 8) out[(uint64_t)b * 8 + t] = buf[TREE_LEVELS & 1][0][t];
}
#endif

// Input nodes of a later pass: node idx of object o is in[prev_blk0[o] + idx]; prev_blk0 = the previous pass's blk0.
struct TreePassInput {
    const uint32_t* in;
    const uint32_t* prev_blk0;
    __host__ __device__ uint32_t inputs(int o) const { return prev_blk0[o + 1] - prev_blk0[o]; }
    __host__ __device__ void load(const TreeBlock& tb, uint64_t idx, uint32_t* out) const {
        tree_copy8(out, in + ((uint64_t)prev_blk0[tb.obj] + idx) * 8);
    }
};

// ---- One launch per request (the `*_set` entry points) ----------------------------------------------------------
// The leaf phase and in-block folding as above, with SET_THREADS input nodes per block (SET_LEVELS = log2 of it:
// smaller blocks spread a small request over more SMs). Then each block stores its node in nodes[b], and the LAST
// block of an object to finish (a per-object atomic counter, after a release fence) folds that object's nodes to
// the root itself, SET_THREADS at a time, in place in `nodes` (the node of sub-block sb goes to index sb, which no
// later sub-block of that level reads), writes the digest words to digests[8·o] and resets the counter to 0 for the
// next launch (a captured graph replays the same counters). An object with one block writes its root directly.
// The fold reads other blocks' nodes through L2 (ld.global.cg): this SM's L1 may hold an earlier launch's lines.
template <int THREADS>
struct TreeSetShape {
    static constexpr int LEVELS = THREADS == 32 ? 5 : THREADS == 64 ? 6 : THREADS == 128 ? 7 : 8;
    static_assert(THREADS == 32 || THREADS == 64 || THREADS == 128 || THREADS == 256, "THREADS: 32/64/128/256");
};

__host__ __device__ inline void tree_load8_l2(uint32_t* dst, const uint32_t* src) {
#ifdef __CUDA_ARCH__
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = __ldcg(src + i);
#else
    tree_copy8(dst, src);
#endif
}

#ifdef __CUDACC__
template <int THREADS, class H>
__device__ inline void tree_set_run(const H& h, const uint32_t* blk0, int n_obj, uint32_t* nodes, uint32_t* done,
                                    uint32_t* digests) {
    constexpr int LEVELS = TreeSetShape<THREADS>::LEVELS;
    __shared__ uint32_t buf[2][THREADS][8];
    __shared__ int last;
    uint32_t b = blockIdx.x;
    int t = threadIdx.x;
    TreeBlock tb;
    tb.obj = tree_object_of(blk0, n_obj, b);
    tb.bo = b - blk0[tb.obj];
    tb.n_in = h.inputs(tb.obj);
    uint64_t idx = (uint64_t)tb.bo * THREADS + t;
    if (idx < tb.n_in) h.leaf(tb, idx, buf[0][t]);
    __syncthreads();
    uint32_t n = tb.n_in;
    for (int l = 1; l <= LEVELS; ++l) {
        tree_level(h, tb, n, l, t, buf[(l - 1) & 1], buf[l & 1], THREADS);
        n = (n + 1) / 2;
        __syncthreads();
    }
    uint32_t first = blk0[tb.obj], nblk = blk0[tb.obj + 1] - first;
    if (nblk == 1) {
        if (t < 8) digests[(uint64_t)tb.obj * 8 + t] = buf[LEVELS & 1][0][t];
        return;
    }
    if (t < 8) nodes[(uint64_t)b * 8 + t] = buf[LEVELS & 1][0][t];
    __threadfence();                       // release: this block's node before its count
    __syncthreads();
    if (t == 0) last = atomicAdd(done + tb.obj, 1u) == nblk - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();                       // acquire: every other block's node after the count
    uint32_t* base = nodes + (uint64_t)first * 8;
    uint32_t cnt = nblk;
    while (cnt > 1) {
        uint32_t subs = (cnt + THREADS - 1) / THREADS;
        for (uint32_t sb = 0; sb < subs; ++sb) {
            TreeBlock fb{tb.obj, sb, cnt};
            uint64_t j = (uint64_t)sb * THREADS + t;
            if (j < cnt) tree_load8_l2(buf[0][t], base + j * 8);
            __syncthreads();
            uint32_t m = cnt;
            for (int l = 1; l <= LEVELS; ++l) {
                tree_level(h, fb, m, l, t, buf[(l - 1) & 1], buf[l & 1], THREADS);
                m = (m + 1) / 2;
                __syncthreads();
            }
            if (t < 8) base[(uint64_t)sb * 8 + t] = buf[LEVELS & 1][0][t];
            __syncthreads();               // the stores before the next sub-block's loads (same block: visible)
        }
        cnt = subs;
    }
    if (t < 8) digests[(uint64_t)tb.obj * 8 + t] = buf[LEVELS & 1][0][t];
    if (t == 0) done[tb.obj] = 0;          // ready for the next launch
}
#endif
