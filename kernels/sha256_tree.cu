// sha256_tree: the `sha256-tree` integrity format (kmesh.integrity.tree documents it; plain-Python reference there):
//   leaf i = SHA-256(0x00 ‖ chunk i), chunks of chunk_bytes, the last one short (its real length, never padded),
//            an empty object = one empty leaf;
//   node   = SHA-256(0x01 ‖ left ‖ right); levels pair nodes from the left, an odd last node is carried up unchanged;
//   digest = the root (a single leaf is its own root).
// All chunks of all objects hash in parallel (one thread per chunk), then the tree levels: 8 per launch in shared
// memory (kernels/integrity_tree.cuh), further launches of sha256_tree_nodes until each object has its root.
//
// Memory layout: ptrs[n_obj] (uint64 device addresses), lens[n_obj] (bytes); chunks are read by 32-bit words when
// ptr and chunk_bytes are multiples of 4, by bytes otherwise. Nodes: 8 uint32 words h0..h7 (host order; digest
// bytes = each word big-endian). blk0 / prev_blk0: per-pass block prefix sums (integrity_tree.cuh).
// Bytes: the leaf pass reads every object byte once and writes 32 bytes per block; a node pass reads 32 bytes per
// input node. Launch: grid.x = blk0[n_obj], block TREE_THREADS = 256, 16 KiB static shared memory.
#include "sha256_common.cuh"
#include "integrity_tree.cuh"

struct Sha256TreeLeaves {
    const uint64_t* ptrs;
    const uint64_t* lens;
    uint32_t chunk_bytes;
    __host__ __device__ uint32_t inputs(int o) const {
        uint64_t n = (lens[o] + chunk_bytes - 1) / chunk_bytes;
        return n == 0 ? 1u : (uint32_t)n;
    }
    __host__ __device__ void leaf(const TreeBlock& tb, uint64_t idx, uint32_t* out) const {
        uint64_t off = idx * chunk_bytes, len = lens[tb.obj];
        uint64_t n = len - off < chunk_bytes ? len - off : chunk_bytes;   // len == 0: idx 0, n = 0
        const uint8_t* p = (const uint8_t*)(uintptr_t)ptrs[tb.obj] + off;
        km_prefetch_l2(p, n < 4096 ? n : 4096);   // the first blocks; double buffering hides the rest
        sha256_message(out, p, n, 0x00);
    }
    __host__ __device__ void node(const uint32_t* l, const uint32_t* r, bool, uint32_t* out) const {
        sha256_node(out, l, r);
    }
};

struct Sha256TreeNodes {
    TreePassInput src;
    __host__ __device__ uint32_t inputs(int o) const { return src.inputs(o); }
    __host__ __device__ void leaf(const TreeBlock& tb, uint64_t idx, uint32_t* out) const { src.load(tb, idx, out); }
    __host__ __device__ void node(const uint32_t* l, const uint32_t* r, bool, uint32_t* out) const {
        sha256_node(out, l, r);
    }
};

extern "C" __global__ __launch_bounds__(TREE_THREADS) void
sha256_tree_leaves(const uint64_t* ptrs, const uint64_t* lens, uint32_t chunk_bytes, const uint32_t* blk0, int n_obj,
                   uint32_t* out) {
    Sha256TreeLeaves h{ptrs, lens, chunk_bytes};
    tree_block_run(h, blk0, n_obj, out);
}

extern "C" __global__ __launch_bounds__(TREE_THREADS) void
sha256_tree_nodes(const uint32_t* in, const uint32_t* prev_blk0, const uint32_t* blk0, int n_obj, uint32_t* out) {
    Sha256TreeNodes h{{in, prev_blk0}};
    tree_block_run(h, blk0, n_obj, out);
}

// One launch per request (integrity_tree.cuh, tree_set_run): every leaf, every node level and each object's root in
// one grid; arguments as blake3_set_N (kernels/blake3.cu) plus chunk_bytes.
extern "C" __global__ __launch_bounds__(64) void
sha256_tree_set_64(const uint64_t* ptrs, const uint64_t* lens, uint32_t chunk_bytes, const uint32_t* tables,
                   int passes, int n_obj, uint32_t* nodes, uint32_t* counters, uint32_t* digests) {
    tree_set_run<64>(Sha256TreeLeaves{ptrs, lens, chunk_bytes}, TreeSetTables{tables, passes, n_obj}, nodes,
                    counters, digests);
}
extern "C" __global__ __launch_bounds__(128) void
sha256_tree_set_128(const uint64_t* ptrs, const uint64_t* lens, uint32_t chunk_bytes, const uint32_t* tables,
                   int passes, int n_obj, uint32_t* nodes, uint32_t* counters, uint32_t* digests) {
    tree_set_run<128>(Sha256TreeLeaves{ptrs, lens, chunk_bytes}, TreeSetTables{tables, passes, n_obj}, nodes,
                    counters, digests);
}
extern "C" __global__ __launch_bounds__(256) void
sha256_tree_set_256(const uint64_t* ptrs, const uint64_t* lens, uint32_t chunk_bytes, const uint32_t* tables,
                   int passes, int n_obj, uint32_t* nodes, uint32_t* counters, uint32_t* digests) {
    tree_set_run<256>(Sha256TreeLeaves{ptrs, lens, chunk_bytes}, TreeSetTables{tables, passes, n_obj}, nodes,
                    counters, digests);
}
