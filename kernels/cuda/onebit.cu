// 1-bit sign compression with error feedback (mpidl.kernels.pack_signs / unpack_signs).
// Conventions as in kernels/reference.py: bit 1 = negative, element i is bit i % 8 of
// byte i / 8; one scale (mean |v|) per chunk of `size` elements.
// Loaded by kernels/gpu.py with cupy.RawModule; compiled by nvcc in tests/test_kernels_cuda.py.

extern "C" {

// Sum of |x + r| (r only if use_r) over each chunk; block b handles unit b of the chunk
// pieces, `block` elements long, and adds its sum to sums[chunk] (double atomics).
__global__ void chunk_abs_sums(const float* __restrict__ x, const float* __restrict__ r,
                               int use_r, long long n, long long size, long long per,
                               long long block, double* __restrict__ sums) {
    long long u = blockIdx.x;
    long long c = u / per;
    long long lo = c * size + (u - c * per) * block;
    long long hi = min(min(n, (c + 1) * size), lo + block);
    double s = 0.0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = use_r ? x[i] + r[i] : x[i];
        s += (double)fabsf(v);
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

// One thread per output byte: 8 signs, and r <- v - (+-scale) for the same 8 elements.
__global__ void pack_signs(const float* __restrict__ x, float* __restrict__ r, int use_r,
                           const float* __restrict__ scales, long long size, long long n,
                           unsigned char* __restrict__ bits) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long nbytes = (n + 7) / 8;
    if (b >= nbytes) return;
    unsigned int acc = 0;
    for (int j = 0; j < 8; ++j) {
        long long i = b * 8 + j;
        if (i >= n) break;
        float sc = scales[i / size];
        float v = use_r ? __fadd_rn(x[i], r[i]) : x[i];
        bool neg = v < 0.0f;
        acc |= (unsigned int)neg << j;
        if (use_r) r[i] = __fsub_rn(v, neg ? -sc : sc);
    }
    bits[b] = (unsigned char)acc;
}

__global__ void unpack_signs(const unsigned char* __restrict__ bits,
                             const float* __restrict__ scales, long long size, long long n,
                             float* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float sc = scales[i / size];
    out[i] = ((bits[i >> 3] >> (i & 7)) & 1) ? -sc : sc;
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
