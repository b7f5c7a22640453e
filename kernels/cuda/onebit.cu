// 1-bit sign compression with error feedback (mpidl.kernels.pack_signs / unpack_signs).
// Conventions as in kernels/reference.py: bit 1 = negative, element i is bit i % 8 of
// byte i / 8; one scale (mean |v|) per chunk of `size` elements.
// Loaded by kernels/gpu.py with cupy.RawModule; compiled by nvcc in tests/test_kernels_cuda.py.

extern "C" {

// The packed sign bit of v (kernels/__init__.py): 1 exactly for v < 0, i.e. the bit
// patterns of negative, nonzero, non-NaN floats (0x80000001 .. 0xFF800000 = -inf). Tested
// on the bits, so no compiler flag can change what a NaN (of either sign) or -0 gives: 0.
__device__ __forceinline__ bool sign_bit(float v) {
    unsigned int u = __float_as_uint(v);
    return u > 0x80000000u && u <= 0xFF800000u;
}

// Per-chunk sums (double): mode 0 |x|, 1 |x + r|, 2 x^2. Block b handles work unit b,
// a piece of `block` elements of chunk b / per, and adds its sum to sums[chunk].
__global__ void chunk_sums(const float* __restrict__ x, const float* __restrict__ r, int mode,
                           long long n, long long size, long long per, long long block,
                           double* __restrict__ sums) {
    long long u = blockIdx.x;
    long long c = u / per;
    long long lo = c * size + (u - c * per) * block;
    long long hi = min(min(n, (c + 1) * size), lo + block);
    double s = 0.0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = mode == 1 ? __fadd_rn(x[i], r[i]) : x[i];
        s += mode == 2 ? (double)v * (double)v : (double)fabsf(v);
    }
    __shared__ double part[256];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(&sums[c], part[0]);
}

// Per-chunk max of the |x| bit patterns: integer order is float order for |x|, and every
// NaN pattern lies above +inf, so one NaN makes the chunk's maximum a NaN.
__global__ void chunk_max_bits(const float* __restrict__ x, long long n, long long size,
                               long long per, long long block, unsigned int* __restrict__ out) {
    long long u = blockIdx.x;
    long long c = u / per;
    long long lo = c * size + (u - c * per) * block;
    long long hi = min(min(n, (c + 1) * size), lo + block);
    unsigned int m = 0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x)
        m = max(m, __float_as_uint(x[i]) & 0x7FFFFFFFu);
    __shared__ unsigned int part[256];
    part[threadIdx.x] = m;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) part[threadIdx.x] = max(part[threadIdx.x], part[threadIdx.x + w]);
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicMax(&out[c], part[0]);
}

// Per-chunk split sums for two scales: sum of v over v >= 0 (NaN counted there), their
// count, and the sum of |v| (the negative class's sum is the difference, as on the CPU).
__global__ void chunk_split_sums(const float* __restrict__ x, const float* __restrict__ r,
                                 int use_r, long long n, long long size, long long per,
                                 long long block, double* __restrict__ spos,
                                 unsigned long long* __restrict__ cpos,
                                 double* __restrict__ sabs) {
    long long u = blockIdx.x;
    long long c = u / per;
    long long lo = c * size + (u - c * per) * block;
    long long hi = min(min(n, (c + 1) * size), lo + block);
    double sp = 0.0, sn = 0.0;
    unsigned long long cp = 0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = use_r ? __fadd_rn(x[i], r[i]) : x[i];
        sn += (double)fabsf(v);
        if (!sign_bit(v)) { sp += (double)v; cp += 1; }  // NaN counts here
    }
    __shared__ double psp[256], psn[256];
    __shared__ unsigned long long pcp[256];
    psp[threadIdx.x] = sp; psn[threadIdx.x] = sn; pcp[threadIdx.x] = cp;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) {
            psp[threadIdx.x] += psp[threadIdx.x + w];
            psn[threadIdx.x] += psn[threadIdx.x + w];
            pcp[threadIdx.x] += pcp[threadIdx.x + w];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        atomicAdd(&spos[c], psp[0]);
        atomicAdd(&sabs[c], psn[0]);
        atomicAdd(&cpos[c], pcp[0]);
    }
}

// One thread per output byte: 8 signs, and r <- v - decoded (+pos or -neg) for them.
__global__ void pack_signs(const float* __restrict__ x, float* __restrict__ r, int use_r,
                           const float* __restrict__ pos, const float* __restrict__ neg,
                           long long size, long long n, unsigned char* __restrict__ bits) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long nbytes = (n + 7) / 8;
    if (b >= nbytes) return;
    unsigned int acc = 0;
    for (int j = 0; j < 8; ++j) {
        long long i = b * 8 + j;
        if (i >= n) break;
        long long c = i / size;
        float v = use_r ? __fadd_rn(x[i], r[i]) : x[i];
        bool isneg = sign_bit(v);
        acc |= (unsigned int)isneg << j;
        if (use_r) r[i] = __fsub_rn(v, isneg ? -neg[c] : pos[c]);
    }
    bits[b] = (unsigned char)acc;
}

__global__ void unpack_signs(const unsigned char* __restrict__ bits,
                             const float* __restrict__ pos, const float* __restrict__ neg,
                             long long size, long long n, float* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long c = i / size;
    out[i] = ((bits[i >> 3] >> (i & 7)) & 1) ? -neg[c] : pos[c];
}

// Flags (0/1 bytes) to packed bits, one thread per output byte.
__global__ void pack_flags(const unsigned char* __restrict__ flags, long long m,
                           unsigned char* __restrict__ bits) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= (m + 7) / 8) return;
    unsigned int acc = 0;
    for (int j = 0; j < 8 && b * 8 + j < m; ++j) acc |= (unsigned int)(flags[b * 8 + j] != 0) << j;
    bits[b] = (unsigned char)acc;
}

}  // extern "C"
