// sha256_common.cuh: the SHA-256 compression function (FIPS 180-4) and message hashing, as __host__ __device__
// code shared by kernels/sha256.cu (whole object, one thread per object) and kernels/sha256_tree.cu (leaves and
// nodes of the sha256-tree format). Host-callable so that tests/integrity_host/harness.cu runs exactly this code
// on a CPU and compares it with hashlib.
//
// A message is an optional one-byte prefix (the sha256-tree domain separator 0x00 / 0x01) followed by `len`
// bytes at `data`. Full 64-byte blocks are read as 32-bit words when `data` is 4-byte aligned (the prefix shifts
// them by one byte: __byte_perm joins neighbouring words); the final one or two blocks (data tail, 0x80, zeros,
// 64-bit big-endian bit length) are assembled byte by byte. Unaligned data takes the byte path throughout.
#pragma once
#include <stdint.h>

#ifdef __CUDA_ARCH__
#define KM_ROTR32(x, n) __funnelshift_r((x), (x), (n))
#define KM_BSWAP32(x) __byte_perm((x), 0u, 0x0123)
#define KM_PERM(x, y, s) __byte_perm((x), (y), (s))
#else
#define KM_ROTR32(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
#define KM_BSWAP32(x) __builtin_bswap32(x)
// host twin of __byte_perm for the selectors used here (each nibble picks byte 0-7 of y:x)
static inline uint32_t km_perm_host(uint32_t x, uint32_t y, uint32_t s) {
    uint64_t v = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
#define KM_PERM(x, y, s) km_perm_host((x), (y), (s))
#endif

#define SHA256_DIGEST_WORDS 8

// Ask L2 for n bytes from p (128-byte lines) so that a thread's later sequential loads hit L2, not DRAM.
__host__ __device__ inline void km_prefetch_l2(const void* p, uint64_t n) {
#ifdef __CUDA_ARCH__
    const char* c = (const char*)p;
    for (uint64_t o = 0; o < n; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
#else
    (void)p; (void)n;
#endif
}

#define KM_SHA256_K_LIST                                                                                       \
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,     \
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,     \
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,     \
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,     \
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,     \
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,     \
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,     \
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u

// Round constants: constant memory on the device (the fully unrolled rounds read K[i] at one compile-time index
// per round, so every thread of a warp reads the same word), a plain array on the host.
__constant__ uint32_t km_sha256_k_dev[64] = {KM_SHA256_K_LIST};
static const uint32_t km_sha256_k_host[64] = {KM_SHA256_K_LIST};

__host__ __device__ inline void sha256_init(uint32_t h[8]) {
    h[0] = 0x6a09e667u; h[1] = 0xbb67ae85u; h[2] = 0x3c6ef372u; h[3] = 0xa54ff53au;
    h[4] = 0x510e527fu; h[5] = 0x9b05688cu; h[6] = 0x1f83d9abu; h[7] = 0x5be0cd19u;
}

// One 64-byte block; w[0..15] are the block's big-endian words (overwritten: the schedule is rolled in place).
__host__ __device__ inline void sha256_compress(uint32_t h[8], uint32_t w[16]) {
#ifdef __CUDA_ARCH__
    const uint32_t* K = km_sha256_k_dev;
#else
    const uint32_t* K = km_sha256_k_host;
#endif
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        uint32_t wi;
        if (i < 16) {
            wi = w[i];
        } else {
            uint32_t w15 = w[(i + 1) & 15], w2 = w[(i + 14) & 15];
            uint32_t s0 = KM_ROTR32(w15, 7) ^ KM_ROTR32(w15, 18) ^ (w15 >> 3);
            uint32_t s1 = KM_ROTR32(w2, 17) ^ KM_ROTR32(w2, 19) ^ (w2 >> 10);
            wi = w[i & 15] = w[i & 15] + s0 + w[(i + 9) & 15] + s1;
        }
        uint32_t S1 = KM_ROTR32(e, 6) ^ KM_ROTR32(e, 11) ^ KM_ROTR32(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t t1 = hh + S1 + ch + K[i] + wi;
        uint32_t S0 = KM_ROTR32(a, 2) ^ KM_ROTR32(a, 13) ^ KM_ROTR32(a, 22);
        uint32_t mj = (a & b) ^ (a & c) ^ (b & c);
        uint32_t t2 = S0 + mj;
        hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
}

// Byte i of the message prefix‖data (prefix < 0: none); 0x80 right after the message, then zeros.
__host__ __device__ inline uint32_t sha256_msg_byte(const uint8_t* data, uint64_t len, int prefix, uint64_t i) {
    uint64_t p = prefix >= 0 ? 1 : 0;
    if (i < p) return (uint32_t)prefix;
    if (i < p + len) return data[i - p];
    return i == p + len ? 0x80u : 0u;
}

// The full-block words of block `blk` (every byte is message), 4-byte aligned data.
__host__ __device__ inline void sha256_load_full(uint32_t w[16], const uint8_t* data, int prefix, uint64_t blk) {
    const uint32_t* d = (const uint32_t*)data;
    if (prefix < 0) {
#pragma unroll
        for (int j = 0; j < 16; ++j) w[j] = KM_BSWAP32(d[blk * 16 + j]);
    } else {
        // message byte 64·blk + 4j + k = data[64·blk + 4j + k − 1]: byte 3 of the previous data word, then
        // bytes 0..2 of this one, big-endian.
        uint32_t prev = blk == 0 ? ((uint32_t)prefix << 24) : d[blk * 16 - 1];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            uint32_t cur = d[blk * 16 + j];
            w[j] = KM_PERM(prev, cur, 0x3456);
            prev = cur;
        }
    }
}

// SHA-256 of prefix‖data[0:len] into h (8 words, host order). Aligned full blocks by words, the rest by bytes.
__host__ __device__ inline void sha256_message(uint32_t h[8], const uint8_t* data, uint64_t len, int prefix) {
    sha256_init(h);
    uint64_t total = len + (prefix >= 0 ? 1 : 0);
    uint64_t full = total / 64;
    // Word reads must stay inside the data: with a prefix, block blk's last word is data bytes 64·blk + 60..63
    // (byte 63 unused), so only blocks with 64·blk + 64 <= len take the word path; the others the byte path.
    bool aligned = (((uintptr_t)data) & 3) == 0;
    uint64_t fast = !aligned ? 0 : (prefix < 0 ? full : (len / 64 < full ? len / 64 : full));
    uint32_t w[16];
    if (fast > 0) {
        // word path, double-buffered: block blk + 1's loads are in flight while block blk compresses (one
        // compression, ~64 dependent rounds, outlasts a DRAM load)
        uint32_t nx[16];
        sha256_load_full(w, data, prefix, 0);
#pragma unroll 1
        for (uint64_t blk = 0; blk < fast; ++blk) {
            if (blk + 1 < fast) sha256_load_full(nx, data, prefix, blk + 1);
            sha256_compress(h, w);
#pragma unroll
            for (int j = 0; j < 16; ++j) w[j] = nx[j];
        }
    }
    for (uint64_t blk = fast; blk < full; ++blk) {
        {
            for (int j = 0; j < 16; ++j) {
                uint64_t i = blk * 64 + 4 * j;
                w[j] = (sha256_msg_byte(data, len, prefix, i) << 24) | (sha256_msg_byte(data, len, prefix, i + 1) << 16) |
                       (sha256_msg_byte(data, len, prefix, i + 2) << 8) | sha256_msg_byte(data, len, prefix, i + 3);
            }
        }
        sha256_compress(h, w);
    }
    // tail: remaining message bytes, 0x80, zeros, and the 64-bit bit length in the last 8 bytes
    uint64_t rem = total - full * 64;
    int tail_blocks = rem + 9 <= 64 ? 1 : 2;
    uint64_t bits = total * 8;
    for (int t = 0; t < tail_blocks; ++t) {
        for (int j = 0; j < 16; ++j) {
            uint32_t word = 0;
            for (int k = 0; k < 4; ++k) {
                uint64_t i = (full + t) * 64 + 4 * j + k;
                word = (word << 8) | sha256_msg_byte(data, len, prefix, i);
            }
            w[j] = word;
        }
        if (t == tail_blocks - 1) {
            w[14] = (uint32_t)(bits >> 32);
            w[15] = (uint32_t)bits;
        }
        sha256_compress(h, w);
    }
}

// Digest words (big-endian SHA-256 output) stored as bytes: out[4i..4i+3] = h[i] big-endian.
__host__ __device__ inline void sha256_store(uint8_t* out, const uint32_t h[8]) {
    for (int i = 0; i < 8; ++i) {
        out[4 * i] = (uint8_t)(h[i] >> 24); out[4 * i + 1] = (uint8_t)(h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(h[i] >> 8); out[4 * i + 3] = (uint8_t)h[i];
    }
}

// sha256-tree node: SHA-256(0x01 ‖ left ‖ right), left/right 32-byte digests as 8 big-endian words each.
// 65 bytes = two blocks: [01, L0..L31, R0..R30] and [R31, 80, 0…, length 520 bits].
__host__ __device__ inline void sha256_node(uint32_t h[8], const uint32_t l[8], const uint32_t r[8]) {
    uint32_t w[16];
    sha256_init(h);
    // byte stream s = 01 ‖ L ‖ R; word j of block 0 = s[4j..4j+3]: (prev word's low byte) ‖ (3 high bytes of next)
    uint32_t prev = 0x01u;
    for (int j = 0; j < 16; ++j) {
        uint32_t cur = j < 8 ? l[j] : r[j - 8];
        w[j] = (prev << 24) | (cur >> 8);
        prev = cur & 0xffu;
    }
    sha256_compress(h, w);
    w[0] = (prev << 24) | 0x00800000u;
    for (int j = 1; j < 15; ++j) w[j] = 0;
    w[15] = 65u * 8u;
    w[14] = 0;
    sha256_compress(h, w);
}
