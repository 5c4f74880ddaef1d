// Gather/scatter packing kernels for one unit's coalesced collectives.
//
// Every op is the same "segmented copy": parameter i owns R_i rank segments of
// seg_i = ceil(n_i / world) elements, and each segment moves between a per-rank
// stride of seg_i (the parameter's own flat storage) and a per-rank stride of S
// (the collective buffer, in which parameter i starts at offset off_i):
//
//   pack_shards     : shard_i[j]          -> buf[off_i + j]           (R_i = 1)
//   unpack_gathered : buf[r*S + off_i + j] -> param_i[r*seg_i + j]   (only the
//                     first n_i elements of the padded flat value are written)
//   pack_grads      : grad_i[r*seg_i + j] -> buf[r*S + off_i + j]    (padding and
//                     null gradients are written as zeros)
//
// Work is split into tiles of `tile` elements that never straddle a rank
// segment, so within a tile both sides are contiguous and can use vector
// accesses. Tiles are numbered per parameter through a prefix sum (one prefix
// per op, built once per layout on the host); a block finds its parameter with a
// binary search over that prefix, then walks its tile with all its threads.
// Blocks iterate over tiles in a grid-stride loop, so one launch covers the
// whole unit for any mix of many small and few large parameters. The tile size
// and grid are chosen on the host (cupy_impl.TILE, BLOCK); blocks must have at
// most 256 threads (launch bounds).
//
// The kernels use no shared memory and no block-level synchronisation: every
// thread's work depends only on (tile, threadIdx), which keeps them correct for
// any block size and lets them be executed one thread at a time by a host
// emulation in the tests.
//
// Metadata layout (one int64 array per layout, P parameters):
//   [0P, 1P)  seg_i          shard numel
//   [1P, 2P)  numel_i        unpadded numel
//   [2P, 3P)  off_i          offset of parameter i inside one rank's S elements
//   [3P, 4P)  cpr_i          tiles per rank segment, ceil(seg_i / tile)
//   [4P + m*(P+1), 4P + (m+1)*(P+1))   tile prefix for op m (PFSM_OP_* below)
//
// `ptrs[i]` is the per-parameter address (the side that is not the collective
// buffer). PFSM_SKIP means "not part of this launch" (used when parameters of one
// unit have different dtypes and need one launch per dtype); a null pointer in
// pack_grads means "no gradient", i.e. zeros.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef long long pfsm_i64;
typedef unsigned long long pfsm_u64;

#define PFSM_SKIP (-1LL)
#define PFSM_OP_PACK_SHARDS 0
#define PFSM_OP_UNPACK_GATHERED 1
#define PFSM_OP_PACK_GRADS 2

namespace pfsm {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
    return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Conversions go through fp32 with round-to-nearest-even, which is exactly what
// torch's copy_ does for these dtypes (bf16 and fp16 widen to fp32 exactly), so
// results match the torch path bit for bit on finite values. Same-dtype copies
// move the bits unchanged.
template <typename S, typename D> struct Convert {
    static __device__ __forceinline__ D apply(S v) { return from_float<D>(to_float<S>(v)); }
};
template <typename T> struct Convert<T, T> {
    static __device__ __forceinline__ T apply(T v) { return v; }
};

template <typename T, int V> struct alignas(sizeof(T) * V) Vec {
    T v[V];
};

template <typename S, typename D, int V>
__device__ __forceinline__ void store_converted(Vec<D, V>* dst, const Vec<S, V>& a) {
    Vec<D, V> b;
#pragma unroll
    for (int e = 0; e < V; ++e) b.v[e] = Convert<S, D>::apply(a.v[e]);
    *dst = b;
}

// The 32 bits starting `bits` bits into the little-endian pair (a, b). Written as a
// 64-bit shift: it compiles to one SHF on the device and also runs on the host.
__device__ __forceinline__ unsigned funnel(unsigned a, unsigned b, unsigned bits) {
    return static_cast<unsigned>(((static_cast<pfsm_u64>(b) << 32) | a) >> bits);
}

// 16 bytes starting `4 * word + bits / 8` bytes into the 32 bytes (lo, hi). The
// switch keeps every word in a register (indexing a local array with a run-time
// value would spill it to local memory); `word` is the same for the whole run.
__device__ __forceinline__ uint4 shift_words(const uint4& lo, const uint4& hi, unsigned word,
                                             unsigned bits) {
    switch (word) {
        case 0:
            return make_uint4(funnel(lo.x, lo.y, bits), funnel(lo.y, lo.z, bits),
                              funnel(lo.z, lo.w, bits), funnel(lo.w, hi.x, bits));
        case 1:
            return make_uint4(funnel(lo.y, lo.z, bits), funnel(lo.z, lo.w, bits),
                              funnel(lo.w, hi.x, bits), funnel(hi.x, hi.y, bits));
        case 2:
            return make_uint4(funnel(lo.z, lo.w, bits), funnel(lo.w, hi.x, bits),
                              funnel(hi.x, hi.y, bits), funnel(hi.y, hi.z, bits));
        default:
            return make_uint4(funnel(lo.w, hi.x, bits), funnel(hi.x, hi.y, bits),
                              funnel(hi.y, hi.z, bits), funnel(hi.z, hi.w, bits));
    }
}

// Same-dtype copy of n elements whose source and destination are misaligned
// differently modulo 16 bytes (odd parameter sizes make this the common case
// when unpacking a gathered bucket). A scalar head aligns the destination; then
// each thread writes aligned 16-byte vectors, each assembled from the two
// aligned source vectors it straddles (shift_words). Both loads are aligned and
// stay inside the 16-byte chunks that hold the run's own bytes, and neighbouring
// threads share chunks, so memory traffic stays ~1x. As in copy_run, U vectors'
// loads are issued before any store so they are in flight together.
template <typename T>
__device__ __forceinline__ void shifted_copy_run(const T* __restrict__ src, T* __restrict__ dst,
                                                 pfsm_i64 n) {
    constexpr int V = 16 / sizeof(T);
    constexpr int U = 4;
    const pfsm_i64 tid = threadIdx.x;
    const pfsm_i64 nthreads = blockDim.x;
    const pfsm_u64 da = (reinterpret_cast<pfsm_u64>(dst) / sizeof(T)) % V;
    pfsm_i64 head = static_cast<pfsm_i64>((V - da) % V);
    if (head > n) head = n;
    for (pfsm_i64 k = tid; k < head; k += nthreads) dst[k] = src[k];
    const pfsm_i64 nvec = (n - head) / V;
    const pfsm_u64 from = reinterpret_cast<pfsm_u64>(src + head);
    const unsigned shift = static_cast<unsigned>(from % 16);  // bytes, nonzero here
    const uint4* __restrict__ chunks = reinterpret_cast<const uint4*>(from - shift);
    uint4* __restrict__ out = reinterpret_cast<uint4*>(dst + head);
    const unsigned word = shift / 4;
    const unsigned bits = (shift % 4) * 8;
    pfsm_i64 k = tid;
    for (; k + (U - 1) * nthreads < nvec; k += U * nthreads) {
        uint4 lo[U], hi[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            lo[u] = chunks[k + u * nthreads];
            hi[u] = chunks[k + u * nthreads + 1];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) out[k + u * nthreads] = shift_words(lo[u], hi[u], word, bits);
    }
    for (; k < nvec; k += nthreads) out[k] = shift_words(chunks[k], chunks[k + 1], word, bits);
    for (pfsm_i64 k2 = head + nvec * V + tid; k2 < n; k2 += nthreads) dst[k2] = src[k2];
}

template <typename S, typename D> struct SameType { static constexpr bool value = false; };
template <typename T> struct SameType<T, T> { static constexpr bool value = true; };

// Copies n contiguous elements with all threads of the block. When source and
// destination share the same misalignment (in elements) modulo the vector width,
// a scalar head brings both to a vector boundary and the body moves V elements
// per access (16 bytes on the wider side); a same-dtype copy with different
// misalignments takes shifted_copy_run; anything else falls back to coalesced
// scalar accesses. Per-parameter addresses arrive as integers, so the compiler
// is told they are global memory; without that it emits generic accesses.
template <typename S, typename D>
__device__ __forceinline__ void copy_run(const S* __restrict__ src, D* __restrict__ dst,
                                         pfsm_i64 n) {
    constexpr int V = 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
    const pfsm_i64 tid = threadIdx.x;
    const pfsm_i64 nthreads = blockDim.x;
    __builtin_assume(__isGlobal(src));
    __builtin_assume(__isGlobal(dst));
    const pfsm_u64 sa = (reinterpret_cast<pfsm_u64>(src) / sizeof(S)) % V;
    const pfsm_u64 da = (reinterpret_cast<pfsm_u64>(dst) / sizeof(D)) % V;
    pfsm_i64 done = 0;
    if constexpr (SameType<S, D>::value) {
        if (sa != da && n >= 2 * V) {
            shifted_copy_run<S>(src, dst, n);
            return;
        }
    }
    if (sa == da) {
        pfsm_i64 head = static_cast<pfsm_i64>((V - sa) % V);
        if (head > n) head = n;
        for (pfsm_i64 k = tid; k < head; k += nthreads) dst[k] = Convert<S, D>::apply(src[k]);
        const pfsm_i64 nvec = (n - head) / V;
        const Vec<S, V>* vs = reinterpret_cast<const Vec<S, V>*>(src + head);
        Vec<D, V>* vd = reinterpret_cast<Vec<D, V>*>(dst + head);
        // Each thread first issues U independent 16-byte loads, then converts
        // and stores them: the loads stay in flight together, which a plain
        // loop cannot do because the compiler must assume dst may alias src.
        constexpr int U = 4;
        pfsm_i64 k = tid;
        for (; k + (U - 1) * nthreads < nvec; k += U * nthreads) {
            Vec<S, V> a[U];
#pragma unroll
            for (int u = 0; u < U; ++u) a[u] = vs[k + u * nthreads];
#pragma unroll
            for (int u = 0; u < U; ++u) store_converted<S, D, V>(vd + k + u * nthreads, a[u]);
        }
        for (; k < nvec; k += nthreads) store_converted<S, D, V>(vd + k, vs[k]);
        done = head + nvec * V;
    }
    for (pfsm_i64 k = done + tid; k < n; k += nthreads) dst[k] = Convert<S, D>::apply(src[k]);
}

template <typename D>
__device__ __forceinline__ void zero_run(D* __restrict__ dst, pfsm_i64 n) {
    __builtin_assume(__isGlobal(dst));
    const D zero = from_float<D>(0.0f);
    for (pfsm_i64 k = threadIdx.x; k < n; k += blockDim.x) dst[k] = zero;
}

// Index of the parameter owning tile t: the largest i with prefix[i] <= t.
// Parameters with no tiles have prefix[i] == prefix[i + 1] and are never chosen.
__device__ __forceinline__ pfsm_i64 find_param(const pfsm_i64* __restrict__ prefix,
                                               pfsm_i64 nparams, pfsm_i64 t) {
    pfsm_i64 lo = 0;
    pfsm_i64 hi = nparams - 1;
    while (lo < hi) {
        const pfsm_i64 mid = (lo + hi + 1) >> 1;
        if (prefix[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

template <typename S, typename D, int OP>
__device__ __forceinline__ void segmented_copy(const pfsm_i64* __restrict__ meta, pfsm_i64 nparams,
                                               const pfsm_i64* __restrict__ ptrs, pfsm_i64 base,
                                               pfsm_i64 total, pfsm_i64 tile) {
    const pfsm_i64* seg = meta;
    const pfsm_i64* numel = meta + nparams;
    const pfsm_i64* off = meta + 2 * nparams;
    const pfsm_i64* cpr = meta + 3 * nparams;
    const pfsm_i64* prefix = meta + 4 * nparams + OP * (nparams + 1);
    const pfsm_i64 ntiles = prefix[nparams];
    for (pfsm_i64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const pfsm_i64 i = find_param(prefix, nparams, t);
        const pfsm_i64 p = ptrs[i];
        if (p == PFSM_SKIP) continue;
        const pfsm_i64 local = t - prefix[i];
        const pfsm_i64 s = seg[i];
        const pfsm_i64 r = local / cpr[i];
        const pfsm_i64 start = (local - r * cpr[i]) * tile;
        pfsm_i64 cnt = s - start;
        if (cnt > tile) cnt = tile;
        pfsm_i64 valid = numel[i] - r * s - start;
        if (valid > cnt) valid = cnt;
        if (valid < 0) valid = 0;
        if (OP == PFSM_OP_PACK_SHARDS) {
            const S* src = reinterpret_cast<const S*>(p) + start;
            D* dst = reinterpret_cast<D*>(base) + off[i] + start;
            copy_run<S, D>(src, dst, cnt);
        } else if (OP == PFSM_OP_UNPACK_GATHERED) {
            const S* src = reinterpret_cast<const S*>(base) + r * total + off[i] + start;
            D* dst = reinterpret_cast<D*>(p) + r * s + start;
            copy_run<S, D>(src, dst, valid);
        } else {
            D* dst = reinterpret_cast<D*>(base) + r * total + off[i] + start;
            if (p == 0) valid = 0;
            if (valid > 0) {
                copy_run<S, D>(reinterpret_cast<const S*>(p) + r * s + start, dst, valid);
            }
            zero_run<D>(dst + valid, cnt - valid);
        }
    }
}

}  // namespace pfsm

#define PFSM_ENTRY(op, OPID, sname, S, dname, D)                                      \
    extern "C" __global__ void __launch_bounds__(256) pfsm_##op##_##sname##_##dname(  \
        const pfsm_i64* __restrict__ meta, pfsm_i64 nparams,                           \
        const pfsm_i64* __restrict__ ptrs, pfsm_i64 base, pfsm_i64 total,              \
        pfsm_i64 tile) {                                                               \
        pfsm::segmented_copy<S, D, OPID>(meta, nparams, ptrs, base, total, tile);      \
    }

#define PFSM_ENTRY_DST(op, OPID, sname, S)              \
    PFSM_ENTRY(op, OPID, sname, S, f32, float)          \
    PFSM_ENTRY(op, OPID, sname, S, bf16, __nv_bfloat16) \
    PFSM_ENTRY(op, OPID, sname, S, f16, __half)

#define PFSM_ENTRY_PAIRS(op, OPID)                     \
    PFSM_ENTRY_DST(op, OPID, f32, float)               \
    PFSM_ENTRY_DST(op, OPID, bf16, __nv_bfloat16)      \
    PFSM_ENTRY_DST(op, OPID, f16, __half)

PFSM_ENTRY_PAIRS(pack_shards, PFSM_OP_PACK_SHARDS)
PFSM_ENTRY_PAIRS(unpack_gathered, PFSM_OP_UNPACK_GATHERED)
PFSM_ENTRY_PAIRS(pack_grads, PFSM_OP_PACK_GRADS)
