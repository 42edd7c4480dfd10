/* The GPU row kernels of a table's batch, compiled at run time by CuPy's RawModule (kernels/cupy_rows.py).
 *
 *   gather_rows    the batch's unique rows, in id order, from the hot-row cache (HBM) or the pool
 *                  mapping (host memory the GPU reads over the link) into a dense block [U, W]
 *   bag_forward    each bag's sum / mean / weighted sum of its lookups' rows, from that block
 *   update_rows    the fused backward + update of each unique row, in the block: its lookups'
 *                  gradients summed in lookup order (no float atomics), then SGD or row-wise Adagrad
 *   scatter_rows   the updated rows back into the pool mapping, and into their cache slots
 *
 * One warp per row or bag; lanes walk the columns, so a warp's loads are one coalesced run. Pointers
 * travel as 64-bit integers (the pool mapping's device address equals its host address: unified
 * addressing), sizes as long long, in floats.
 *
 * Determinism and the CPU path: every float operation is an explicit round-to-nearest intrinsic
 * (__fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn, __fmaf_rn), which the compiler never contracts or
 * reorders, in the order kernels/rows.c computes them, so the update is bit-identical to the C kernel:
 * a row's gradients in lookup order, Adagrad's sum of squares in column order.
 */

#define WARP 32
#define MAX_CHUNKS 8 /* columns per lane in update_rows: dim <= 256 */

__device__ __forceinline__ long long warp_index() { return ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP; }
__device__ __forceinline__ int lane_index() { return threadIdx.x % WARP; }

/* out[u, :w] = (slot_of[ids[u]] >= 0 ? cache[slot] : src[ids[u]])[:w] for u < count, in words of T
 * (float, or float4 where every width, stride and address allows 16-byte accesses).
 * slot_of == 0: no cache. src == 0: every row is cached (the pool is not mapped). */
template <typename T>
__device__ __forceinline__ void gather(unsigned long long out_, long long out_stride, unsigned long long src_,
                                       long long src_stride, unsigned long long ids_, long long count,
                                       long long width, unsigned long long cache_, long long cache_stride,
                                       unsigned long long slot_of_)
{
    const long long u = warp_index();
    if (u >= count)
        return;
    const long long row = ((const long long *)ids_)[u];
    const int *slot_of = (const int *)slot_of_;
    const int slot = slot_of ? slot_of[row] : -1;
    const T *from = slot >= 0 ? (const T *)cache_ + slot * cache_stride : (const T *)src_ + row * src_stride;
    T *to = (T *)out_ + u * out_stride;
    for (long long c = lane_index(); c < width; c += WARP)
        to[c] = from[c];
}

extern "C" __global__ void gather_rows(unsigned long long out_, long long out_stride, unsigned long long src_,
                                       long long src_stride, unsigned long long ids_, long long count,
                                       long long width, unsigned long long cache_, long long cache_stride,
                                       unsigned long long slot_of_)
{
    gather<float>(out_, out_stride, src_, src_stride, ids_, count, width, cache_, cache_stride, slot_of_);
}

extern "C" __global__ void gather_rows4(unsigned long long out_, long long out_stride, unsigned long long src_,
                                        long long src_stride, unsigned long long ids_, long long count,
                                        long long width, unsigned long long cache_, long long cache_stride,
                                        unsigned long long slot_of_)
{
    gather<float4>(out_, out_stride, src_, src_stride, ids_, count, width, cache_, cache_stride, slot_of_);
}

/* out[b, :dim] = the pooled rows of bag b: lookups [offsets[b], offsets[b+1]) (the last ends at n),
 * lookup i's row being rows[inverse[i]]; times psw[i] when given; divided by the length in mode mean
 * (an empty bag pools to zeros). Added in lookup order. */
extern "C" __global__ void bag_forward(unsigned long long out_, unsigned long long rows_, long long row_stride,
                                       unsigned long long inverse_, unsigned long long offsets_, long long bags,
                                       long long n, unsigned long long psw_, int mean, long long dim)
{
    const long long b = warp_index();
    if (b >= bags)
        return;
    const long long *inverse = (const long long *)inverse_;
    const long long *offsets = (const long long *)offsets_;
    const float *psw = (const float *)psw_;
    const float *rows = (const float *)rows_;
    const long long start = offsets[b], end = b + 1 < bags ? offsets[b + 1] : n;
    float *out = (float *)out_ + b * dim;
    for (long long c = lane_index(); c < dim; c += WARP) {
        float acc = 0.0f;
        for (long long i = start; i < end; i++) {
            const float v = rows[inverse[i] * row_stride + c];
            acc = __fadd_rn(acc, psw ? __fmul_rn(v, psw[i]) : v);
        }
        if (mean && end > start)
            acc = __fdiv_rn(acc, (float)(end - start));
        out[c] = acc;
    }
}

/* The fused update of unique rows u < count of the block rows [U, row_stride] (state [U, state_stride],
 * column 0, Adagrad only), in place. Row u's lookups are order[starts[u] .. starts[u+1]) (lookup order);
 * lookup i's gradient is grad[bag_of[i], :dim], times 1/len(bag) in mode mean, or times psw[i].
 *   rule 0 (SGD):                w = fma(-lr, g, w)
 *   rule 1 (row-wise Adagrad):   s = s + sum(g*g)/dim;  w = fma(-lr, g / (sqrt(s) + eps), w)
 * exactly as kernels/rows.c's UPDATE_ROWS_BODY rounds them. dim <= WARP * MAX_CHUNKS. */
extern "C" __global__ void update_rows(unsigned long long rows_, long long row_stride,
                                       unsigned long long state_, long long state_stride,
                                       unsigned long long order_, unsigned long long starts_,
                                       unsigned long long bag_of_, unsigned long long offsets_, long long bags,
                                       long long n, unsigned long long psw_, int mean,
                                       unsigned long long grad_, long long grad_stride,
                                       long long count, long long dim, int rule, float lr, float eps)
{
    const long long u = warp_index();
    if (u >= count)
        return;
    const int lane = lane_index();
    const long long *order = (const long long *)order_;
    const long long *starts = (const long long *)starts_;
    const long long *bag_of = (const long long *)bag_of_;
    const long long *offsets = (const long long *)offsets_;
    const float *psw = (const float *)psw_;
    const float *grad = (const float *)grad_;
    float *w = (float *)rows_ + u * row_stride;
    float acc[MAX_CHUNKS];
#pragma unroll
    for (int k = 0; k < MAX_CHUNKS; k++)
        acc[k] = 0.0f;
    for (long long j = starts[u]; j < starts[u + 1]; j++) {
        const long long i = order[j];
        const long long bag = bag_of[i];
        float scale = 1.0f;
        const int scaled = mean || psw;
        if (mean) {
            const long long end = bag + 1 < bags ? offsets[bag + 1] : n;
            scale = __frcp_rn((float)(end - offsets[bag])); /* 1.0f / len, correctly rounded, as the C kernel */
        } else if (psw) {
            scale = psw[i];
        }
        const float *g = grad + bag * grad_stride;
#pragma unroll
        for (int k = 0; k < MAX_CHUNKS; k++) {
            const long long c = lane + (long long)k * WARP;
            if (c < dim)
                acc[k] = __fadd_rn(acc[k], scaled ? __fmul_rn(g[c], scale) : g[c]);
        }
    }
    if (rule == 0) {
#pragma unroll
        for (int k = 0; k < MAX_CHUNKS; k++) {
            const long long c = lane + (long long)k * WARP;
            if (c < dim)
                w[c] = __fmaf_rn(-lr, acc[k], w[c]);
        }
        return;
    }
    /* Adagrad's sum of squares in column order, as the C loop adds it: every lane adds every column's
     * square in turn (each column's value broadcast from the lane that holds it), so all agree. */
    float squares = 0.0f;
#pragma unroll
    for (int k = 0; k < MAX_CHUNKS; k++) {
        for (int from = 0; from < WARP; from++) {
            const float v = __shfl_sync(0xffffffffu, acc[k], from);
            if (from + (long long)k * WARP < dim)
                squares = __fadd_rn(squares, __fmul_rn(v, v));
        }
    }
    float *s = (float *)state_ + u * state_stride;
    const float accumulated = __fadd_rn(*s, __fdiv_rn(squares, (float)dim));
    const float denom = __fadd_rn(__fsqrt_rn(accumulated), eps);
    __syncwarp();
    if (lane == 0)
        *s = accumulated;
#pragma unroll
    for (int k = 0; k < MAX_CHUNKS; k++) {
        const long long c = lane + (long long)k * WARP;
        if (c < dim)
            w[c] = __fmaf_rn(-lr, __fdiv_rn(acc[k], denom), w[c]);
    }
}

/* dst[ids[u], :w] = values[u, :w] (the pool mapping; dst == 0: none), and the cached ones into their
 * slots too, for u < count. */
extern "C" __global__ void scatter_rows(unsigned long long dst_, long long dst_stride,
                                        unsigned long long values_, long long values_stride,
                                        unsigned long long ids_, long long count, long long width,
                                        unsigned long long cache_, long long cache_stride,
                                        unsigned long long slot_of_)
{
    const long long u = warp_index();
    if (u >= count)
        return;
    const long long *ids = (const long long *)ids_;
    const int *slot_of = (const int *)slot_of_;
    const long long row = ids[u];
    const int slot = slot_of ? slot_of[row] : -1;
    const float *from = (const float *)values_ + u * values_stride;
    float *to = dst_ ? (float *)dst_ + row * dst_stride : 0;
    float *cached = slot >= 0 ? (float *)cache_ + slot * cache_stride : 0;
    for (long long c = lane_index(); c < width; c += WARP) {
        const float v = from[c];
        if (to)
            to[c] = v;
        if (cached)
            cached[c] = v;
    }
}
