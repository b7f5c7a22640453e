// Selection keys and sparse index streams (mpidl.kernels threshold/top-k helpers and
// encode_sparse). Layout of the stream in kernels/wire.py: gaps d[i] = idx[i] - idx[i-1] - 1,
// either `width` bits each (8 gaps fill exactly `width` bytes) or LEB128 varints.

extern "C" {

// The selection key |v| with every NaN as +inf, and the packed sign bit (1 for v < 0:
// never for a NaN or -0), both decided on the bit pattern (see kernels/__init__.py).
__device__ __forceinline__ float sel_key(float v) {
    unsigned int a = __float_as_uint(v) & 0x7FFFFFFFu;
    return __uint_as_float(a > 0x7F800000u ? 0x7F800000u : a);
}

__device__ __forceinline__ bool sign_bit(float v) {
    unsigned int u = __float_as_uint(v);
    return u > 0x80000000u && u <= 0xFF800000u;
}

// |x| with NaN counted as +inf: the ordering key of every selection kernel.
__global__ void magnitude(const float* __restrict__ x, long long n, float* __restrict__ key) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    key[i] = sel_key(x[i]);
}

// ---- Order-preserving compaction. A block owns a tile of 2048 elements (256 threads, two
// quads each: elements tile + h * 1024 + 4 * thread + j), finds the selected ones, ranks
// them in index order with one block-wide scan, takes room for them in `stage` with one
// atomicAdd on `counter`, and records where (tile_off) and how many (tile_cnt). A gather
// kernel then reads the tiles back in tile order, given the inclusive prefix sum of
// tile_cnt (tile_end), so the result is sorted without a sort. Entries past `cap` are not
// written, but `counter` still counts them: the caller sees the overflow and runs again.
#define TILE 2048

// Exclusive prefix sum of v over the block (256 threads); *total gets the block's sum.
__device__ unsigned int block_scan(unsigned int v, unsigned int* total) {
    __shared__ unsigned int warp_sums[8];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned int inc = v;
    for (int d = 1; d < 32; d <<= 1) {
        unsigned int y = __shfl_up_sync(0xFFFFFFFFu, inc, d);
        if (lane >= d) inc += y;
    }
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        unsigned int w = lane < 8 ? warp_sums[lane] : 0;
        for (int d = 1; d < 8; d <<= 1) {
            unsigned int y = __shfl_up_sync(0xFFFFFFFFu, w, d);
            if (lane >= d) w += y;
        }
        if (lane < 8) warp_sums[lane] = w;
    }
    __syncthreads();
    *total = warp_sums[7];
    return (warp ? warp_sums[warp - 1] : 0) + inc - v;
}

// flags[h] bit j: element tile + h * 1024 + 4 * threadIdx.x + j is selected. Both halves'
// counts go through one scan as c0 | c1 << 16 (a half holds at most 1024).
__device__ void compact_tile(const unsigned int flags[2], long long* __restrict__ stage,
                             long long cap, unsigned long long* __restrict__ counter,
                             unsigned long long* __restrict__ tile_off,
                             unsigned int* __restrict__ tile_cnt) {
    __shared__ unsigned long long base;
    unsigned int total;
    unsigned int off = block_scan(__popc(flags[0]) | (__popc(flags[1]) << 16), &total);
    unsigned int total0 = total & 0xFFFFu;
    unsigned int count = total0 + (total >> 16);
    if (threadIdx.x == 0) {
        base = count ? atomicAdd(counter, (unsigned long long)count) : 0;
        tile_off[blockIdx.x] = base;
        tile_cnt[blockIdx.x] = count;
    }
    __syncthreads();
    long long tile = (long long)blockIdx.x * TILE;
    for (int h = 0; h < 2; ++h) {
        long long pos = (long long)base + (h ? total0 + (off >> 16) : (off & 0xFFFFu));
        long long i = tile + h * 1024 + 4 * threadIdx.x;
        for (int j = 0; j < 4; ++j) {
            if (!((flags[h] >> j) & 1)) continue;
            if (pos < cap) stage[pos] = i + j;
            ++pos;
        }
    }
}

// Four floats from i on (v[j] = 0 past n), one float4 load when `vec` (16-byte aligned).
__device__ __forceinline__ void load4(const float* __restrict__ p, long long i, long long n,
                                      int vec, float v[4]) {
    if (vec && i + 3 < n) {
        float4 a = *reinterpret_cast<const float4*>(p + i);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    } else {
        for (int j = 0; j < 4; ++j) v[j] = i + j < n ? p[i + j] : 0.0f;
    }
}

// Strom's threshold, the pass over n: v = x (+ r) written to r, and |v| > tau compacted.
// (The selected entries' r -= sign * tau is threshold_gather's, in output order.)
__global__ void threshold_tiles(const float* __restrict__ x, float* __restrict__ r, int use_r,
                                int vec, float tau, long long n, long long* __restrict__ stage,
                                long long cap, unsigned long long* __restrict__ counter,
                                unsigned long long* __restrict__ tile_off,
                                unsigned int* __restrict__ tile_cnt) {
    unsigned int flags[2];
    for (int h = 0; h < 2; ++h) {
        long long i = (long long)blockIdx.x * TILE + h * 1024 + 4 * threadIdx.x;
        float v[4];
        load4(x, i, n, vec, v);
        if (use_r) {
            float b[4];
            load4(r, i, n, vec, b);
            for (int j = 0; j < 4; ++j) v[j] = __fadd_rn(v[j], b[j]);
            if (vec && i + 3 < n) {
                *reinterpret_cast<float4*>(r + i) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
                for (int j = 0; j < 4; ++j)
                    if (i + j < n) r[i + j] = v[j];
            }
        }
        flags[h] = 0;
        for (int j = 0; j < 4; ++j)  // NaN: +inf > tau (finite)
            flags[h] |= (unsigned int)(i + j < n && sel_key(v[j]) > tau) << j;
    }
    compact_tile(flags, stage, cap, counter, tile_off, tile_cnt);
}

// DGC's candidates: key >= t and key > 0, t = the high 32 bits of *kth (radix_pass).
__global__ void at_least_tiles(const float* __restrict__ x, int vec,
                               const unsigned long long* __restrict__ kth, long long n,
                               long long* __restrict__ stage, long long cap,
                               unsigned long long* __restrict__ counter,
                               unsigned long long* __restrict__ tile_off,
                               unsigned int* __restrict__ tile_cnt) {
    unsigned int t = (unsigned int)(*kth >> 32);
    t = t ? t : 1u;  // key > 0 as well
    unsigned int flags[2];
    for (int h = 0; h < 2; ++h) {
        long long i = (long long)blockIdx.x * TILE + h * 1024 + 4 * threadIdx.x;
        float v[4];
        load4(x, i, n, vec, v);
        flags[h] = 0;
        for (int j = 0; j < 4; ++j)
            flags[h] |= (unsigned int)(i + j < n && __float_as_uint(sel_key(v[j])) >= t) << j;
    }
    compact_tile(flags, stage, cap, counter, tile_off, tile_cnt);
}

// Entries of keys[0, n) that are >= *kth (the final cut of an exact top-k).
__global__ void at_least_u64_tiles(const unsigned long long* __restrict__ keys,
                                   const unsigned long long* __restrict__ kth, long long n,
                                   long long* __restrict__ stage, long long cap,
                                   unsigned long long* __restrict__ counter,
                                   unsigned long long* __restrict__ tile_off,
                                   unsigned int* __restrict__ tile_cnt) {
    unsigned long long t = *kth;
    unsigned int flags[2];
    for (int h = 0; h < 2; ++h) {
        long long i = (long long)blockIdx.x * TILE + h * 1024 + 4 * threadIdx.x;
        flags[h] = 0;
        for (int j = 0; j < 4; ++j)
            flags[h] |= (unsigned int)(i + j < n && keys[i + j] >= t) << j;
    }
    compact_tile(flags, stage, cap, counter, tile_off, tile_cnt);
}

// The tile holding output j: the first with tile_end > j (tile_end is non-decreasing).
__device__ __forceinline__ long long find_tile(const long long* __restrict__ tile_end,
                                               long long ntiles, long long j) {
    long long lo = 0, hi = ntiles - 1;
    while (lo < hi) {
        long long mid = (lo + hi) >> 1;
        if (tile_end[mid] > j) hi = mid; else lo = mid + 1;
    }
    return lo;
}

__device__ __forceinline__ long long staged(const long long* __restrict__ stage,
                                            const unsigned long long* __restrict__ tile_off,
                                            const unsigned int* __restrict__ tile_cnt,
                                            const long long* __restrict__ tile_end,
                                            long long t, long long j) {
    return stage[tile_off[t] + (j - (tile_end[t] - tile_cnt[t]))];
}

// out[j] = the j-th compacted entry (through `map` with use_map). With want_keys, also the
// selection key of x[out[j]] as (key bits << 32) | ~j: distinct, and larger for a larger
// key or, on ties, a lower index, so the k largest of them are a top-k with its tie rule.
__global__ void gather_tiles(const long long* __restrict__ stage,
                             const unsigned long long* __restrict__ tile_off,
                             const unsigned int* __restrict__ tile_cnt,
                             const long long* __restrict__ tile_end, long long ntiles,
                             long long total, int use_map, const long long* __restrict__ map,
                             long long* __restrict__ out, int want_keys,
                             const float* __restrict__ x, unsigned long long* __restrict__ keys) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= total) return;
    long long i = staged(stage, tile_off, tile_cnt, tile_end, find_tile(tile_end, ntiles, j), j);
    if (use_map) i = map[i];
    out[j] = i;
    if (want_keys)
        keys[j] = ((unsigned long long)__float_as_uint(sel_key(x[i])) << 32) |
                  (0xFFFFFFFFull - (unsigned long long)j);
}

// Threshold's output, one thread per 8 entries: indices, the sign byte, and (with a
// residual, which holds v) r -= sign * tau; otherwise v is read from x.
__global__ void threshold_gather(const long long* __restrict__ stage,
                                 const unsigned long long* __restrict__ tile_off,
                                 const unsigned int* __restrict__ tile_cnt,
                                 const long long* __restrict__ tile_end, long long ntiles,
                                 long long total, const float* __restrict__ x,
                                 float* __restrict__ r, int use_r, float tau,
                                 long long* __restrict__ out, unsigned char* __restrict__ neg) {
    long long j0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (j0 >= total) return;
    long long t = find_tile(tile_end, ntiles, j0);
    unsigned int byte = 0;
    for (long long j = j0; j < j0 + 8 && j < total; ++j) {
        while (tile_end[t] <= j) ++t;
        long long i = staged(stage, tile_off, tile_cnt, tile_end, t, j);
        out[j] = i;
        float v = use_r ? r[i] : x[i];
        bool ng = sign_bit(v);
        byte |= (unsigned int)ng << (j - j0);
        if (use_r) r[i] = __fsub_rn(v, ng ? -tau : tau);
    }
    neg[j0 >> 3] = (unsigned char)byte;
}

// ---- The rank-th largest of n uint64 keys, 8 bits per launch from the top (shift 56, 48,
// ..): state[0] holds the answer's bits found so far, state[1] the rank still wanted among
// the keys that match them, state[2] counts finished blocks; hist[256] is zero between
// launches. The last block to finish picks the digit and resets hist and state[2].
__global__ void radix_init(unsigned long long* __restrict__ state, unsigned int* __restrict__ hist,
                           long long rank) {
    hist[threadIdx.x] = 0;
    if (threadIdx.x == 0) { state[0] = 0; state[1] = (unsigned long long)rank; state[2] = 0; }
}

__global__ void radix_pass(const unsigned long long* __restrict__ keys, long long n, int shift,
                           unsigned long long* __restrict__ state, unsigned int* __restrict__ hist) {
    __shared__ unsigned int h[256];
    __shared__ bool last;
    h[threadIdx.x] = 0;
    __syncthreads();
    unsigned long long prefix = state[0];
    unsigned long long high = shift >= 56 ? 0ull : ~0ull << (shift + 8);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned long long key = keys[i];
        if ((key & high) == prefix) atomicAdd(&h[(key >> shift) & 255], 1u);
    }
    __syncthreads();
    if (h[threadIdx.x]) atomicAdd(&hist[threadIdx.x], h[threadIdx.x]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&state[2], 1ull) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    int digit = 255 - threadIdx.x;  // thread 0 has the highest digit
    unsigned int count = atomicExch(&hist[digit], 0u);
    unsigned long long rank = state[1];  // read by all before the scan's barriers
    unsigned int total;
    unsigned int above = block_scan(count, &total);  // keys with a higher digit
    if (above < rank && above + count >= rank) {
        state[0] = prefix | ((unsigned long long)digit << shift);
        state[1] = rank - above;
    }
    if (threadIdx.x == 0) state[2] = 0;
}

// Sample keys as radix_pass wants them: the key bits of x[sample[i]] in the high half.
__global__ void sample_keys(const float* __restrict__ x, const long long* __restrict__ sample,
                            long long m, unsigned long long* __restrict__ keys) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    keys[i] = (unsigned long long)__float_as_uint(sel_key(x[sample[i]])) << 32;
}

// Gaps and their bit lengths; bad[0] = 1 if indices are not strictly increasing in [0, n).
__global__ void gaps(const long long* __restrict__ idx, long long k, long long n,
                     unsigned long long* __restrict__ gap, int* __restrict__ bitlen,
                     int* __restrict__ bad) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= k) return;
    long long prev = i ? idx[i - 1] : -1;
    long long cur = idx[i];
    if (cur <= prev || cur >= n) { *bad = 1; return; }
    unsigned long long g = (unsigned long long)(cur - prev - 1);
    gap[i] = g;
    bitlen[i] = g ? 64 - __clzll((long long)g) : 0;
}

// Fixed width: one thread per group of 8 gaps, which own `width` whole bytes.
__global__ void pack_fixed(const unsigned long long* __restrict__ gap, long long k, int width,
                           long long nout, unsigned char* __restrict__ out) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g * 8 >= k) return;
    for (int b = 0; b < width && g * width + b < nout; ++b) {
        unsigned int byte = 0;
        for (int bit = 0; bit < 8; ++bit) {
            long long pos = (long long)b * 8 + bit;  // bit within the group
            long long j = g * 8 + pos / width;
            if (j < k && ((gap[j] >> (pos % width)) & 1ULL)) byte |= 1u << bit;
        }
        out[g * width + b] = (unsigned char)byte;
    }
}

// Varint: one thread per gap, writing at its byte offset (an exclusive prefix sum).
__global__ void pack_varint(const unsigned long long* __restrict__ gap,
                            const long long* __restrict__ offset, long long k,
                            unsigned char* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= k) return;
    unsigned long long g = gap[i];
    long long p = offset[i];
    while (g >= 128ULL) {
        out[p++] = (unsigned char)((g & 0x7FULL) | 0x80ULL);
        g >>= 7;
    }
    out[p] = (unsigned char)g;
}

// out[idx[j]] += val[j] (atomics: the order of additions may differ from the CPU).
__global__ void scatter_add(const long long* __restrict__ idx, const float* __restrict__ val,
                            long long m, float* __restrict__ out) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < m) atomicAdd(&out[idx[j]], val[j]);
}

}  // extern "C"
