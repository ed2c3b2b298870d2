// Host harness: runs the integrity kernels' own __host__ __device__ code on the CPU, in the order the GPU runs it.
// Built by tests/test_integrity_kernels.py with nvcc (host code only; no GPU needed), as a program (below) and as a
// shared library whose emu_* functions emulate single kernel launches (for kmesh.integrity.gpu under a fake cupy).
//
//   harness MODE CHUNK_BYTES MISALIGN FILE LEN...
// MODE: sha256 | sha256-tree | blake3. FILE holds the objects back to back (LEN bytes each). Each object is copied
// to its own heap buffer at MISALIGN bytes past a 16-byte boundary (0: aligned word/vector paths; 1..15: the
// unaligned paths). Prints one hex digest per object.
//
// The passes are planned as kmesh.integrity.gpu plans them; each pass emulates every block of the grid, and within
// a block every thread of a phase before the next phase (the device's __syncthreads order).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../../kernels/sha256.cu"
#include "../../kernels/sha256_tree.cu"
#include "../../kernels/blake3.cu"

// One launch of a tree kernel: `grid` blocks (as the launcher asked for), each block's threads phase by phase.
template <class H>
static void run_grid(const H& h, uint32_t grid, const uint32_t* blk0, int n_obj, uint32_t* out) {
    static uint32_t buf[2][TREE_THREADS][8];
    for (uint32_t b = 0; b < grid; ++b) {
        memset(buf, 0xA5, sizeof(buf));                  // shared memory is never initialized on the device
        TreeBlock tb;
        tb.obj = tree_object_of(blk0, n_obj, b);
        tb.bo = b - blk0[tb.obj];
        tb.n_in = h.inputs(tb.obj);
        for (int t = 0; t < TREE_THREADS; ++t) {
            uint64_t idx = (uint64_t)tb.bo * TREE_THREADS + t;
            if (idx < tb.n_in) h.leaf(tb, idx, buf[0][t]);
        }
        uint32_t n = tb.n_in;
        for (int l = 1; l <= TREE_LEVELS; ++l) {
            for (int t = 0; t < TREE_THREADS; ++t) tree_level(h, tb, n, l, t, buf[(l - 1) & 1], buf[l & 1]);
            n = (n + 1) / 2;
        }
        for (int t = 0; t < 8; ++t) out[(size_t)b * 8 + t] = buf[TREE_LEVELS & 1][0][t];
    }
}

template <class H>
static void run_pass(const H& h, const std::vector<uint32_t>& blk0, int n_obj, std::vector<uint32_t>& out) {
    out.assign((size_t)blk0[n_obj] * 8, 0xdeadbeefu);  // poisoned: every output word must be written
    run_grid(h, blk0[n_obj], blk0.data(), n_obj, out.data());
}

// One launch of a `*_set_N` kernel (integrity_tree.cuh, tree_set_run): blocks run to completion one after another,
// in a scrambled order (the device gives none); the counts and the last arrivals' folds as the device does them.
template <int THREADS, class H>
static void run_set(const H& h, uint32_t grid, const TreeSetTables& ts, uint32_t* nodes, uint32_t* counters,
                    uint32_t* digests) {
    constexpr int LEVELS = TreeSetShape<THREADS>::LEVELS;
    static uint32_t buf[2][THREADS][8];
    std::vector<uint32_t> order(grid);
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin(), order.end(), std::mt19937(grid));
    const uint32_t* blk0 = ts.row(0);
    for (uint32_t b : order) {
        memset(buf, 0xA5, sizeof(buf));
        TreeBlock tb;
        tb.obj = tree_object_of(blk0, ts.n_obj, b);
        tb.bo = b - blk0[tb.obj];
        tb.n_in = h.inputs(tb.obj);
        for (int t = 0; t < THREADS; ++t) {
            uint64_t idx = (uint64_t)tb.bo * THREADS + t;
            if (idx < tb.n_in) h.leaf(tb, idx, buf[0][t]);
        }
        for (int p = 0;; ++p) {
            uint32_t n = tb.n_in;
            for (int l = 1; l <= LEVELS; ++l) {
                for (int t = 0; t < THREADS; ++t) tree_level(h, tb, n, l, t, buf[(l - 1) & 1], buf[l & 1], THREADS);
                n = (n + 1) / 2;
            }
            const uint32_t* row = ts.row(p);
            uint32_t nblk = row[tb.obj + 1] - row[tb.obj];
            if (nblk == 1) {
                for (int t = 0; t < 8; ++t) digests[(size_t)tb.obj * 8 + t] = buf[LEVELS & 1][0][t];
                break;
            }
            uint32_t* level = nodes + 8 * (ts.node_base(p) + row[tb.obj]);
            for (int t = 0; t < 8; ++t) level[(size_t)tb.bo * 8 + t] = buf[LEVELS & 1][0][t];
            uint32_t group = tb.bo / THREADS;
            uint32_t members = std::min<uint32_t>(THREADS, nblk - group * THREADS);
            uint32_t* c = counters + ts.counter_base(p + 1) + ts.row(p + 1)[tb.obj] + group;
            if ((*c)++ != members - 1) break;
            *c = 0;
            memset(buf, 0xA5, sizeof(buf));
            for (uint32_t t = 0; t < members; ++t) tree_load8_l2(buf[0][t], level + ((size_t)group * THREADS + t) * 8);
            tb.bo = group;
            tb.n_in = nblk;
        }
    }
}

// Per-launch emulation of every entry point, for tests/test_integrity_kernels.py's fake cupy (the shared-library
// build of this file): same parameters as the __global__ functions, plus the grid and block the launcher chose.
#define P32(x) ((uint32_t*)(uintptr_t)(x))
#define C32(x) ((const uint32_t*)(uintptr_t)(x))
#define C64(x) ((const uint64_t*)(uintptr_t)(x))
extern "C" int emu_sha256_whole(uint32_t grid, uint32_t block, uint64_t ptrs, uint64_t lens, int n_obj, uint64_t out) {
    for (uint32_t o = 0; o < grid * block; ++o)
        if ((int)o < n_obj) sha256_whole_item(o, C64(ptrs), C64(lens), P32(out));
    return 0;
}
extern "C" int emu_sha256_tree_leaves(uint32_t grid, uint32_t block, uint64_t ptrs, uint64_t lens, uint32_t chunk,
                                      uint64_t blk0, int n_obj, uint64_t out) {
    if (block != TREE_THREADS) return 1;
    run_grid(Sha256TreeLeaves{C64(ptrs), C64(lens), chunk}, grid, C32(blk0), n_obj, P32(out));
    return 0;
}
extern "C" int emu_sha256_tree_nodes(uint32_t grid, uint32_t block, uint64_t in, uint64_t prev, uint64_t blk0, int n_obj,
                                     uint64_t out) {
    if (block != TREE_THREADS) return 1;
    run_grid(Sha256TreeNodes{{C32(in), C32(prev)}}, grid, C32(blk0), n_obj, P32(out));
    return 0;
}
extern "C" int emu_blake3_chunks(uint32_t grid, uint32_t block, uint64_t ptrs, uint64_t lens, uint64_t blk0, int n_obj,
                                 uint64_t out) {
    if (block != TREE_THREADS) return 1;
    run_grid(Blake3Chunks{C64(ptrs), C64(lens)}, grid, C32(blk0), n_obj, P32(out));
    return 0;
}
extern "C" int emu_blake3_parents(uint32_t grid, uint32_t block, uint64_t in, uint64_t prev, uint64_t blk0, int n_obj,
                                  uint64_t out) {
    if (block != TREE_THREADS) return 1;
    run_grid(Blake3Parents{{C32(in), C32(prev)}}, grid, C32(blk0), n_obj, P32(out));
    return 0;
}

#define EMU_SET(N)                                                                                              \
    extern "C" int emu_blake3_set_##N(uint32_t grid, uint32_t block, uint64_t ptrs, uint64_t lens, uint64_t tables, \
                                      int passes, int n_obj, uint64_t nodes, uint64_t counters, uint64_t digests) { \
        if (block != N) return 1;                                                                                   \
        run_set<N>(Blake3Chunks{C64(ptrs), C64(lens)}, grid, TreeSetTables{C32(tables), passes, n_obj},             \
                   P32(nodes), P32(counters), P32(digests));                                                        \
        return 0;                                                                                                   \
    }                                                                                                               \
    extern "C" int emu_sha256_tree_set_##N(uint32_t grid, uint32_t block, uint64_t ptrs, uint64_t lens,             \
                                           uint32_t chunk, uint64_t tables, int passes, int n_obj, uint64_t nodes,  \
                                           uint64_t counters, uint64_t digests) {                                   \
        if (block != N) return 1;                                                                                   \
        run_set<N>(Sha256TreeLeaves{C64(ptrs), C64(lens), chunk}, grid, TreeSetTables{C32(tables), passes, n_obj},  \
                   P32(nodes), P32(counters), P32(digests));                                                        \
        return 0;                                                                                                   \
    }
EMU_SET(64)
EMU_SET(128)
EMU_SET(256)

static std::vector<uint32_t> blocks_for(const std::vector<uint32_t>& counts) {
    std::vector<uint32_t> blk0(counts.size() + 1, 0);
    for (size_t o = 0; o < counts.size(); ++o) blk0[o + 1] = blk0[o] + (counts[o] + TREE_THREADS - 1) / TREE_THREADS;
    return blk0;
}

template <class Leaves, class Nodes>
static std::vector<uint32_t> run_tree(const Leaves& leaves, int n_obj) {
    std::vector<uint32_t> counts(n_obj);
    for (int o = 0; o < n_obj; ++o) counts[o] = leaves.inputs(o);
    std::vector<uint32_t> blk0 = blocks_for(counts), out;
    run_pass(leaves, blk0, n_obj, out);
    while (blk0[n_obj] > (uint32_t)n_obj) {             // some object still has more than one node
        std::vector<uint32_t> prev = blk0, in = out;
        for (int o = 0; o < n_obj; ++o) counts[o] = prev[o + 1] - prev[o];
        blk0 = blocks_for(counts);
        Nodes nodes{{in.data(), prev.data()}};
        run_pass(nodes, blk0, n_obj, out);
    }
    return out;                                          // blk0[o] == o: object o's root at out[8·o]
}

// A whole request, planned here in C++ (independently of kmesh.integrity.gpu): digest words of n_obj objects into
// out[n_obj·8] (sha256 / sha256-tree: big-endian digest words; blake3: chaining-value words). Returns 0, or 2 for
// an unknown mode.
extern "C" int emu_hash(const char* mode, uint32_t chunk, int n_obj, const uint64_t* ptrs, const uint64_t* lens,
                        uint32_t* out) {
    std::string m = mode;
    std::vector<uint32_t> words((size_t)n_obj * 8);
    if (m == "sha256") {
        for (int o = 0; o < n_obj; ++o) sha256_whole_item(o, ptrs, lens, words.data());
    } else if (m == "sha256-tree") {
        words = run_tree<Sha256TreeLeaves, Sha256TreeNodes>(Sha256TreeLeaves{ptrs, lens, chunk}, n_obj);
    } else if (m == "blake3") {
        words = run_tree<Blake3Chunks, Blake3Parents>(Blake3Chunks{ptrs, lens}, n_obj);
    } else {
        return 2;
    }
    memcpy(out, words.data(), words.size() * 4);
    return 0;
}

int main(int argc, char** argv) {
    if (argc < 5) { fprintf(stderr, "usage: harness MODE CHUNK_BYTES MISALIGN FILE LEN...\n"); return 2; }
    std::string mode = argv[1];
    uint32_t chunk = (uint32_t)strtoul(argv[2], nullptr, 10);
    int mis = atoi(argv[3]);
    FILE* f = fopen(argv[4], "rb");
    if (!f) { perror("open"); return 2; }
    int n_obj = argc - 5;
    std::vector<uint64_t> ptrs(n_obj), lens(n_obj);
    std::vector<uint8_t*> bases(n_obj);
    for (int o = 0; o < n_obj; ++o) {
        lens[o] = strtoull(argv[5 + o], nullptr, 10);
        bases[o] = (uint8_t*)aligned_alloc(16, ((lens[o] + mis + 16) / 16) * 16);
        uint8_t* p = bases[o] + mis;
        if (lens[o] && fread(p, 1, lens[o], f) != lens[o]) { fprintf(stderr, "short file\n"); return 2; }
        ptrs[o] = (uint64_t)(uintptr_t)p;
    }
    std::vector<uint32_t> words((size_t)n_obj * 8);
    bool big_endian_words = true;
    if (mode == "sha256") {
        for (int o = 0; o < n_obj; ++o) sha256_whole_item(o, ptrs.data(), lens.data(), words.data());
    } else if (mode == "sha256-tree") {
        words = run_tree<Sha256TreeLeaves, Sha256TreeNodes>(Sha256TreeLeaves{ptrs.data(), lens.data(), chunk}, n_obj);
    } else if (mode == "blake3") {
        words = run_tree<Blake3Chunks, Blake3Parents>(Blake3Chunks{ptrs.data(), lens.data()}, n_obj);
        big_endian_words = false;
    } else {
        fprintf(stderr, "unknown mode %s\n", mode.c_str());
        return 2;
    }
    for (int o = 0; o < n_obj; ++o) {
        for (int i = 0; i < 8; ++i) {
            uint32_t w = words[(size_t)o * 8 + i];
            if (big_endian_words) printf("%08x", w);
            else printf("%02x%02x%02x%02x", w & 0xff, (w >> 8) & 0xff, (w >> 16) & 0xff, w >> 24);
        }
        printf("\n");
        free(bases[o]);
    }
    return 0;
}
