// sha256: whole-object SHA-256 (FIPS 180-4, incl. the padding block), one GPU thread per object — the write-up's
// kernel design, reproduced to measure it: SHA-256 is a chain of 64-byte blocks, so an object is one sequential
// chain and n objects are n chains, whatever the GPU's width.
//
// Memory layout: ptrs[n_obj] (uint64 device addresses) and lens[n_obj] (bytes) describe the objects; any
// alignment works (4-byte aligned data is read by 32-bit words, otherwise by bytes). out[n_obj][8]: the digest
// words h0..h7 (uint32, host order; digest bytes = each word big-endian).
// Bytes: reads every object byte once; writes 32 bytes per object.
// Launch: grid.x = ceil(n_obj / SHA256_THREADS), block SHA256_THREADS (thread o hashes object o). The "serial"
// arm launches once per object (n_obj = 1), the "concurrent" arm once for all objects.
#include "sha256_common.cuh"

#ifndef SHA256_THREADS
#define SHA256_THREADS 32
#endif

__host__ __device__ inline void sha256_whole_item(int o, const uint64_t* ptrs, const uint64_t* lens, uint32_t* out) {
    uint32_t h[8];
    sha256_message(h, (const uint8_t*)(uintptr_t)ptrs[o], lens[o], -1);
    for (int i = 0; i < 8; ++i) out[o * 8 + i] = h[i];
}

extern "C" __global__ __launch_bounds__(SHA256_THREADS) void
sha256_whole(const uint64_t* ptrs, const uint64_t* lens, int n_obj, uint32_t* out) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o < n_obj) sha256_whole_item(o, ptrs, lens, out);
}
