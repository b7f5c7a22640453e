// Counter-based random numbers, stochastic quantization (QSGD, TernGrad) and bit packing
// (mpidl.kernels.quantize / dequantize / pack_bits / unpack_bits / *_indices).
// Bit-exact with kernels/reference.py: the same splitmix64 hash, float32 arithmetic with
// explicit round-to-nearest intrinsics (no FMA contraction), 8 codes per `width` bytes.

extern "C" {

__device__ __forceinline__ unsigned long long splitmix(unsigned long long seed,
                                                       unsigned long long i) {
    unsigned long long z = seed + (i + 1ULL) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float uniform24(unsigned long long seed, unsigned long long i) {
    return (float)(splitmix(seed, i) >> 40) * 5.9604644775390625e-08f;  // 2^-24, exact
}

__global__ void hash_uniform(unsigned long long seed, long long count, float* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) out[i] = uniform24(seed, (unsigned long long)i);
}

__global__ void sample_indices(unsigned long long seed, long long n, long long count,
                               long long* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) out[i] = (long long)(splitmix(seed, (unsigned long long)i) % (unsigned long long)n);
}

// One index in each of k strata [j n / k, (j + 1) n / k).
__global__ void randomk_indices(unsigned long long seed, long long n, long long k,
                                long long* __restrict__ out) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= k) return;
    long long lo = j * n / k;
    long long width = (j + 1) * n / k - lo;
    out[j] = lo + (long long)(splitmix(seed, (unsigned long long)j) % (unsigned long long)width);
}

__device__ __forceinline__ unsigned int quant_code(float a, float mult, int levels, float u) {
    float lv = __fmul_rn(fabsf(a), mult);
    float fl = floorf(lv);
    float q = __fadd_rn(fl, (u < __fsub_rn(lv, fl)) ? 1.0f : 0.0f);
    q = fminf(q, (float)levels);
    int lev = (lv > 0.0f) ? (int)q : 0;  // 0 and NaN give level 0
    return (unsigned int)(a < 0.0f ? levels - lev : levels + lev);
}

// One thread per group of 8 elements -> `width` bytes; one multiplier per chunk of `size`.
__global__ void quantize(const float* __restrict__ x, long long n,
                         const float* __restrict__ mults, long long size, int levels,
                         unsigned long long seed, int width, long long nout,
                         unsigned char* __restrict__ out) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g * 8 >= n) return;
    unsigned long long word = 0;
    for (int j = 0; j < 8; ++j) {
        long long i = g * 8 + j;
        if (i >= n) break;
        word |= (unsigned long long)quant_code(x[i], mults[i / size], levels,
                                               uniform24(seed, (unsigned long long)i)) << (j * width);
    }
    for (int b = 0; b < width && g * width + b < nout; ++b)
        out[g * width + b] = (unsigned char)(word >> (8 * b));
}

// One thread per group: codes back to (code - levels) * step; counts codes > 2 levels.
__global__ void dequantize(const unsigned char* __restrict__ packed, long long npacked,
                           const float* __restrict__ steps, long long size, int levels,
                           int width, long long n, float* __restrict__ out,
                           unsigned long long* __restrict__ bad) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g * 8 >= n) return;
    unsigned long long word = 0;
    for (int b = 0; b < width && g * width + b < npacked; ++b)
        word |= (unsigned long long)packed[g * width + b] << (8 * b);
    unsigned long long mask = (1ULL << width) - 1ULL;
    unsigned long long nbad = 0;
    for (int j = 0; j < 8; ++j) {
        long long i = g * 8 + j;
        if (i >= n) break;
        int c = (int)((word >> (j * width)) & mask);
        nbad += c > 2 * levels;
        out[i] = __fmul_rn((float)(c - levels), steps[i / size]);
    }
    if (nbad) atomicAdd(bad, nbad);
}

__global__ void pack_bits(const unsigned char* __restrict__ codes, long long n, int width,
                          long long nout, unsigned char* __restrict__ out) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g * 8 >= n) return;
    unsigned long long word = 0;
    for (int j = 0; j < 8 && g * 8 + j < n; ++j)
        word |= (unsigned long long)codes[g * 8 + j] << (j * width);
    for (int b = 0; b < width && g * width + b < nout; ++b)
        out[g * width + b] = (unsigned char)(word >> (8 * b));
}

__global__ void unpack_bits(const unsigned char* __restrict__ packed, long long npacked,
                            int width, long long n, unsigned char* __restrict__ out) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g * 8 >= n) return;
    unsigned long long word = 0;
    for (int b = 0; b < width && g * width + b < npacked; ++b)
        word |= (unsigned long long)packed[g * width + b] << (8 * b);
    unsigned long long mask = (1ULL << width) - 1ULL;
    for (int j = 0; j < 8 && g * 8 + j < n; ++j)
        out[g * 8 + j] = (unsigned char)((word >> (j * width)) & mask);
}

}  // extern "C"
