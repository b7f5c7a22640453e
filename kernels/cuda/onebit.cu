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

__global__ void unpack_signs(const unsigned char* __restrict__ bits,
                             const float* __restrict__ pos, const float* __restrict__ neg,
                             long long size, long long n, float* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long c = size >= n ? 0 : i / size;  // no 64-bit division for one chunk
    out[i] = ((bits[i >> 3] >> (i & 7)) & 1) ? -neg[c] : pos[c];
}

// The scales from chunk_sums / chunk_split_sums, in one launch (one thread per chunk),
// with the reference's arithmetic: float64 sums / counts, rounded once to float32.
// One scale: scales[c] = sum |v| / count. Two: scales[2c] = mean of the v >= 0,
// scales[2c + 1] = (sum |v| - their sum) / the count of v < 0; 0 for an empty class.
__global__ void finish_scales(const double* __restrict__ s1, const double* __restrict__ sabs,
                              const unsigned long long* __restrict__ cpos, int two,
                              long long n, long long size, long long nc,
                              float* __restrict__ scales) {
    long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= nc) return;
    long long count = min(size, n - c * size);
    if (count < 0) count = 0;
    if (!two) {
        scales[c] = (float)(s1[c] / (double)(count > 1 ? count : 1));
        return;
    }
    long long cp = (long long)cpos[c];
    long long cn = count - cp;
    scales[2 * c] = cp > 0 ? (float)(s1[c] / (double)cp) : 0.0f;
    scales[2 * c + 1] = cn > 0 ? (float)((sabs[c] - s1[c]) / (double)cn) : 0.0f;
}

// The packing pass, one thread per 4 elements (one float4 load of x and of r when `vec`:
// both 16-byte aligned), grid-stride. A byte holds the signs of two neighbouring threads'
// quads, joined with a warp shuffle; r <- v - decoded with the reference's float32 ops.
// Chunks are multiples of 8 elements, so a quad (and a byte) never straddles two.
// scales: [s0, s1, ...] (one) or [pos0, neg0, pos1, ...] (two).
__global__ void pack_signs4(const float* __restrict__ x, float* __restrict__ r, int use_r,
                            int vec, const float* __restrict__ scales, int two,
                            long long size, long long n, unsigned char* __restrict__ bits) {
    long long nq = (n + 3) / 4;
    long long stride = (long long)gridDim.x * blockDim.x;
    int lane = threadIdx.x & 31;
    for (long long q0 = (long long)blockIdx.x * blockDim.x + (threadIdx.x - lane); q0 < nq;
         q0 += stride) {  // q0 is the same in a whole warp: every lane reaches the shuffle
        long long q = q0 + lane;
        unsigned int nib = 0;
        if (q < nq) {
            long long i = 4 * q;
            long long c = size >= n ? 0 : i / size;
            float p = two ? scales[2 * c] : scales[c];
            float m = -(two ? scales[2 * c + 1] : scales[c]);
            float v[4];
            bool full = vec && i + 3 < n;
            if (full) {
                float4 a = *reinterpret_cast<const float4*>(x + i);
                v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
                if (use_r) {
                    float4 b = *reinterpret_cast<const float4*>(r + i);
                    v[0] = __fadd_rn(v[0], b.x); v[1] = __fadd_rn(v[1], b.y);
                    v[2] = __fadd_rn(v[2], b.z); v[3] = __fadd_rn(v[3], b.w);
                }
            } else {
                for (int j = 0; j < 4; ++j)
                    v[j] = i + j < n ? (use_r ? __fadd_rn(x[i + j], r[i + j]) : x[i + j]) : 0.0f;
            }
            float o[4];
            for (int j = 0; j < 4; ++j) {
                bool sb = sign_bit(v[j]) && i + j < n;
                nib |= (unsigned int)sb << j;
                o[j] = __fsub_rn(v[j], sb ? m : p);
            }
            if (use_r) {
                if (full) {
                    *reinterpret_cast<float4*>(r + i) = make_float4(o[0], o[1], o[2], o[3]);
                } else {
                    for (int j = 0; j < 4; ++j)
                        if (i + j < n) r[i + j] = o[j];
                }
            }
        }
        unsigned int hi = __shfl_down_sync(0xFFFFFFFFu, nib, 1);
        if (!(lane & 1) && q < nq) bits[q >> 1] = (unsigned char)(nib | (hi << 4));
    }
}

}  // extern "C"
