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

// The code of one element (kernels/__init__.py): level 0 where |a| * mult is NaN or <= 0,
// clamped to `levels`; levels - level for a < 0 (checked on the bits: never for a NaN).
__device__ __forceinline__ unsigned int quant_code(float a, float mult, int levels, float u) {
    float lv = __fmul_rn(fabsf(a), mult);
    int lev = 0;
    if (!isnan(lv) && lv > 0.0f) {
        float fl = floorf(lv);
        float q = __fadd_rn(fl, (u < __fsub_rn(lv, fl)) ? 1.0f : 0.0f);  // inf - inf: no
        lev = q < (float)levels ? (int)q : levels;
    }
    unsigned int bits = __float_as_uint(a);
    bool neg = bits > 0x80000000u && bits <= 0xFF800000u;
    return (unsigned int)(neg ? levels - lev : levels + lev);
}

// dequantize: a block of 256 threads owns QTILE elements, whose codes fill
// exactly 256 * width 32-bit words (32 codes per thread). Codes sit in shared memory as
// bytes, with 4 bytes of padding after every 32 so that a thread's word reads and a quad's
// word writes do not share banks; x and the words move with coalesced loads and stores.
#define QTILE 8192

__device__ __forceinline__ int qpad(int c) { return c + ((c >> 5) << 2); }

// Bytes [o, o + 4) of p as one little-endian word (bytes past nbytes: 0); one load when
// `vec` (p 4-byte aligned).
__device__ __forceinline__ unsigned int load_word(const unsigned char* __restrict__ p,
                                                  long long o, long long nbytes, int vec) {
    if (vec && o + 3 < nbytes) return *reinterpret_cast<const unsigned int*>(p + o);
    unsigned int w = 0;
    for (int b = 0; b < 4 && o + b < nbytes; ++b) w |= (unsigned int)p[o + b] << (8 * b);
    return w;
}

// One thread per group of 8 elements -> `width` bytes; one multiplier per chunk of `size`.
// (dequantize's tiled layout measured slower for quantize on an H100: README, "GPU".)
__global__ void quantize(const float* __restrict__ x, long long n,
                         const float* __restrict__ mults, long long size, int levels,
                         unsigned long long seed, int width, long long nout,
                         unsigned char* __restrict__ out) {
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g * 8 >= n) return;
    unsigned long long word = 0;
    float mult = mults[size >= n ? 0 : (g * 8) / size];  // 8 codes share a chunk
    for (int j = 0; j < 8; ++j) {
        long long i = g * 8 + j;
        if (i >= n) break;
        word |= (unsigned long long)quant_code(x[i], mult, levels,
                                               uniform24(seed, (unsigned long long)i)) << (j * width);
    }
    for (int b = 0; b < width && g * width + b < nout; ++b)
        out[g * width + b] = (unsigned char)(word >> (8 * b));
}

// Codes back to (code - levels) * step, one step per chunk; counts codes above 2 levels.
// vec: packed is 4-byte aligned, out 16-byte aligned.
__global__ void dequantize(const unsigned char* __restrict__ packed, long long npacked,
                           const float* __restrict__ steps, long long size, int levels,
                           int width, int vec, long long n, float* __restrict__ out,
                           unsigned long long* __restrict__ bad) {
    __shared__ unsigned int codes[(QTILE + QTILE / 8) / 4];
    __shared__ unsigned int words[256 * 8];
    long long base = (long long)blockIdx.x * QTILE;
    long long obase = (long long)blockIdx.x * (QTILE / 8) * width;
    for (int k = threadIdx.x; k < 256 * width; k += 256) {
        long long o = obase + 4LL * k;
        words[k] = load_word(packed, o, npacked, vec);
    }
    __syncthreads();
    unsigned int mask = (1u << width) - 1u;
    unsigned long long acc = 0;
    int bits = 0, w = 0;
    for (int m = 0; m < 8; ++m) {
        unsigned int quad = 0;
        for (int j = 0; j < 4; ++j) {
            if (bits < width) {
                acc |= (unsigned long long)words[threadIdx.x * width + w++] << bits;
                bits += 32;
            }
            quad |= (unsigned int)(acc & mask) << (8 * j);
            acc >>= width;
            bits -= width;
        }
        codes[qpad(32 * threadIdx.x + 4 * m) >> 2] = quad;
    }
    __syncthreads();
    unsigned long long nbad = 0;
    for (int q = threadIdx.x; q < QTILE / 4; q += 256) {
        long long i = base + 4 * q;
        if (i >= n) break;
        float step = steps[size >= n ? 0 : i / size];
        unsigned int quad = codes[qpad(4 * q) >> 2];
        float v[4];
        for (int j = 0; j < 4; ++j) {
            int c = (int)((quad >> (8 * j)) & 0xFFu);
            nbad += i + j < n && c > 2 * levels;
            v[j] = __fmul_rn((float)(c - levels), step);
        }
        if (vec && i + 3 < n) {
            *reinterpret_cast<float4*>(out + i) = make_float4(v[0], v[1], v[2], v[3]);
        } else {
            for (int j = 0; j < 4 && i + j < n; ++j) out[i + j] = v[j];
        }
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

// float32 <-> float16 on the bits, the same bits as kernels/cpu.py's Numba versions:
// round to nearest even, overflow to +-inf, a NaN stays a quiet NaN of its sign with the
// top 10 payload bits (CUDA's __float2half would return its canonical NaN instead).
__device__ __forceinline__ unsigned short f32_to_f16_bits(unsigned int f) {
    unsigned int sign = (f >> 16) & 0x8000u;
    unsigned int a = f & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (unsigned short)(sign | 0x7E00u | ((a >> 13) & 0x03FFu));
    if (a >= 0x47800000u) return (unsigned short)(sign | 0x7C00u);
    if (a >= 0x38800000u)  // normal: drop 13 mantissa bits, half to even, rebias
        return (unsigned short)(sign | (((a + 0x0FFFu + ((a >> 13) & 1u)) >> 13) - 0x1C000u));
    // subnormal half: round(|x| * 2^24) half to even, via + 1.5 * 2^23 (the product is exact)
    float t = __fadd_rn(__fmul_rn(__uint_as_float(a), 16777216.0f), 12582912.0f);
    return (unsigned short)(sign | (__float_as_uint(t) - 0x4B400000u));
}

__device__ __forceinline__ unsigned int f16_bits_to_f32_bits(unsigned int h) {
    unsigned int sign = (h & 0x8000u) << 16;
    unsigned int em = h & 0x7FFFu;
    if (em >= 0x7C00u) return sign | (em << 13) | 0x7F800000u;  // inf, NaN with its payload
    if (em >= 0x0400u) return sign | ((em << 13) + 0x38000000u);
    return sign | __float_as_uint(__fmul_rn((float)em, 5.9604644775390625e-08f));  // exact
}

// Grid-stride; `vec` (all pointers 16/8-byte aligned): 4 elements per step, float4 loads.
__global__ void to_fp16(const float* __restrict__ x, long long n, int vec,
                        unsigned short* __restrict__ out) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if (vec) {
        long long n4 = n / 4;
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        uint2* o4 = reinterpret_cast<uint2*>(out);
        for (long long q = t; q < n4; q += stride) {
            uint4 v = x4[q];
            uint2 h;
            h.x = (unsigned int)f32_to_f16_bits(v.x) | ((unsigned int)f32_to_f16_bits(v.y) << 16);
            h.y = (unsigned int)f32_to_f16_bits(v.z) | ((unsigned int)f32_to_f16_bits(v.w) << 16);
            o4[q] = h;
        }
        done = n4 * 4;
    }
    for (long long i = done + t; i < n; i += stride)
        out[i] = f32_to_f16_bits(__float_as_uint(x[i]));
}

__global__ void from_fp16(const unsigned short* __restrict__ h, long long n, int vec,
                          float* __restrict__ out) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long done = 0;
    if (vec) {
        long long n4 = n / 4;
        const uint2* h4 = reinterpret_cast<const uint2*>(h);
        uint4* o4 = reinterpret_cast<uint4*>(out);
        for (long long q = t; q < n4; q += stride) {
            uint2 v = h4[q];
            uint4 f;
            f.x = f16_bits_to_f32_bits(v.x & 0xFFFFu);
            f.y = f16_bits_to_f32_bits(v.x >> 16);
            f.z = f16_bits_to_f32_bits(v.y & 0xFFFFu);
            f.w = f16_bits_to_f32_bits(v.y >> 16);
            o4[q] = f;
        }
        done = n4 * 4;
    }
    for (long long i = done + t; i < n; i += stride)
        out[i] = __uint_as_float(f16_bits_to_f32_bits(h[i]));
}

}  // extern "C"
