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

// ---- One launch per request (the `*_set_N` entry points) --------------------------------------------------------
// The same tree as the per-pass kernels, with N = THREADS input nodes per block, in ONE grid: the grid is pass 0's
// blocks (leaves); every later pass's block is done by the LAST of its (up to N) input blocks to finish. A block
// stores its node, counts itself in its parent's counter (after a release fence), and the one that completes the
// count (acquire fence) loads its N siblings' nodes through L2 and folds them as the per-pass kernel would, then
// goes on with the parent's node; the block that makes an object's one root writes the digest. So the tree levels
// fold in parallel across groups (no one-block serial tail), with no launch between them.
//   tables: passes × (n_obj + 1) block prefix sums (pass_tables with N), one row per pass; pass p's nodes at
//           nodes[8·(Σ_{q<p} blocks_q + tables[p][o] + bo)]; pass p ≥ 1's counters at Σ_{1≤q<p} blocks_q +
//           tables[p][o] + group; counters start zeroed and each is zeroed again by the block completing it (a
//           captured graph replays them).
// The loads of siblings' nodes bypass L1 (ld.global.cg): this SM's L1 may hold an earlier launch's lines.
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

// Offsets of pass p in the node and counter arrays (Σ of the earlier passes' blocks).
struct TreeSetTables {
    const uint32_t* tables;
    int passes, n_obj;
    __host__ __device__ const uint32_t* row(int p) const { return tables + (uint64_t)p * (n_obj + 1); }
    __host__ __device__ uint64_t node_base(int p) const {
        uint64_t s = 0;
        for (int q = 0; q < p; ++q) s += row(q)[n_obj];
        return s;
    }
    __host__ __device__ uint64_t counter_base(int p) const {   // p >= 1
        uint64_t s = 0;
        for (int q = 1; q < p; ++q) s += row(q)[n_obj];
        return s;
    }
};

#ifdef __CUDACC__
template <int THREADS, class H>
__device__ inline void tree_set_run(const H& h, const TreeSetTables& ts, uint32_t* nodes, uint32_t* counters,
                                    uint32_t* digests) {
    constexpr int LEVELS = TreeSetShape<THREADS>::LEVELS;
    __shared__ uint32_t buf[2][THREADS][8];
    __shared__ int last;
    int t = threadIdx.x;
    const uint32_t* blk0 = ts.row(0);
    TreeBlock tb;
    tb.obj = tree_object_of(blk0, ts.n_obj, blockIdx.x);
    tb.bo = blockIdx.x - blk0[tb.obj];
    tb.n_in = h.inputs(tb.obj);
    uint64_t idx = (uint64_t)tb.bo * THREADS + t;
    if (idx < tb.n_in) h.leaf(tb, idx, buf[0][t]);
    __syncthreads();
    for (int p = 0;; ++p) {
        // buf[0] holds this block's input nodes of pass p; fold them to the block's one node
        uint32_t n = tb.n_in;
        for (int l = 1; l <= LEVELS; ++l) {
            tree_level(h, tb, n, l, t, buf[(l - 1) & 1], buf[l & 1], THREADS);
            n = (n + 1) / 2;
            __syncthreads();
        }
        const uint32_t* row = ts.row(p);
        uint32_t nblk = row[tb.obj + 1] - row[tb.obj];       // this object's nodes out of pass p
        if (nblk == 1) {                                      // the root
            if (t < 8) digests[(uint64_t)tb.obj * 8 + t] = buf[LEVELS & 1][0][t];
            return;
        }
        uint32_t* level = nodes + 8 * (ts.node_base(p) + row[tb.obj]);
        if (t < 8) level[(uint64_t)tb.bo * 8 + t] = buf[LEVELS & 1][0][t];
        uint32_t group = tb.bo / THREADS;
        uint32_t members = nblk - group * THREADS < THREADS ? nblk - group * THREADS : THREADS;
        __threadfence();                                      // release: the node before the count
        __syncthreads();
        if (t == 0) {
            uint32_t* c = counters + ts.counter_base(p + 1) + ts.row(p + 1)[tb.obj] + group;
            last = atomicAdd(c, 1u) == members - 1;
            if (last) *c = 0;                                 // every member has counted: ready for the next launch
        }
        __syncthreads();
        if (!last) return;
        __threadfence();                                      // acquire: the siblings' nodes after the count
        if ((uint32_t)t < members) tree_load8_l2(buf[0][t], level + ((uint64_t)group * THREADS + t) * 8);
        __syncthreads();
        tb.bo = group;
        tb.n_in = nblk;
    }
}
#endif
