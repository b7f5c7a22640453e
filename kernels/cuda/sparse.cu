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

// Strom's threshold, first half: v = x (+ r) into r, and the selection flags.
__global__ void threshold_flags(const float* __restrict__ x, float* __restrict__ r, int use_r,
                                float tau, long long n, unsigned char* __restrict__ flags) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = use_r ? __fadd_rn(x[i], r[i]) : x[i];
    if (use_r) r[i] = v;
    flags[i] = sel_key(v) > tau;  // NaN: +inf > tau (finite)
}

// Second half, one thread per selected entry: its sign flag, and r -= sign * tau.
__global__ void threshold_send(const long long* __restrict__ idx, long long k, float tau,
                               const float* __restrict__ x, float* __restrict__ r, int use_r,
                               unsigned char* __restrict__ neg) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= k) return;
    long long i = idx[j];
    float v = use_r ? r[i] : x[i];
    bool ng = sign_bit(v);
    neg[j] = ng;
    if (use_r) r[i] = __fsub_rn(v, ng ? -tau : tau);
}

// Flags of DGC's sampled selection: key >= t and key > 0.
__global__ void at_least(const float* __restrict__ x, float t, long long n,
                         unsigned char* __restrict__ flags) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float a = sel_key(x[i]);
    flags[i] = (a >= t) && (a > 0.0f);
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
