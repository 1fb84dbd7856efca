// ExDyna's GPU selection kernels (sparsify/gpu_select.py compiles them with NVRTC, after the
// defines it writes from its constants: PER_LANE, WARPS, TAKE_THREADS, FINE, RANK_CAP).
#define FULL 0xffffffffu

// The inclusive prefix sum of v over the warp's lanes (every lane calls it).
__device__ __forceinline__ unsigned int warp_scan(unsigned int v)
{
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        unsigned int y = __shfl_up_sync(FULL, v, d);
        if (lane >= d) v += y;
    }
    return v;
}

// Each thread of a block has `want` elements to write: reserve room for the whole block's
// with ONE global atomic on `counter` (an atomic per warp on one address serialises at the L2:
// 780 K of them took 0.6 ms on an H200 for 25 M elements) and return this thread's first slot;
// a thread's elements take consecutive slots.  Every thread of the block must call it (it
// synchronises the block); `wsum` holds one word per warp.
__device__ __forceinline__ unsigned long long block_reserve(unsigned int want,
                                                            unsigned long long* counter,
                                                            unsigned int* wsum,
                                                            unsigned long long* base)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const unsigned int incl = warp_scan(want);
    if (lane == 31) wsum[wid] = incl;          // the warp's total
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int run = 0;
        for (int w = 0; w < nwarps; ++w) { unsigned int c = wsum[w]; wsum[w] = run; run += c; }
        *base = run ? atomicAdd(counter, (unsigned long long)run) : 0ull;
    }
    __syncthreads();
    unsigned long long first = *base + wsum[wid] + (incl - want);
    __syncthreads();                           // wsum and base are reused by the next call
    return first;
}

// block_reserve for two counters at once (want_a, want_b at most 1: the block's totals fit 16
// bits each, so one scan carries both): the first slots to *first_a and *first_b; the warps'
// offsets scanned by warp 0 and both atomics issued by one lane.  base holds two words.
__device__ __forceinline__ void block_reserve2(unsigned int want_a, unsigned int want_b,
                                               unsigned long long* counter_a,
                                               unsigned long long* counter_b, unsigned int* wsum,
                                               unsigned long long* base,
                                               unsigned long long* first_a,
                                               unsigned long long* first_b)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const unsigned int want = want_a | (want_b << 16);
    const unsigned int incl = warp_scan(want);
    if (lane == 31) wsum[wid] = incl;
    __syncthreads();
    if (wid == 0) {
        const unsigned int w = lane < nwarps ? wsum[lane] : 0u;
        const unsigned int wi = warp_scan(w);
        if (lane < nwarps) wsum[lane] = wi - w;
        if (lane == 31) {
            const unsigned int ra = wi & 0xffffu, rb = wi >> 16;
            base[0] = ra ? atomicAdd(counter_a, (unsigned long long)ra) : 0ull;
            base[1] = rb ? atomicAdd(counter_b, (unsigned long long)rb) : 0ull;
        }
    }
    __syncthreads();
    const unsigned int before = wsum[wid] + (incl - want);
    *first_a = base[0] + (before & 0xffffu);
    *first_b = base[1] + (before >> 16);
    __syncthreads();                           // wsum and base are reused by the next call
}

// This lane's slot among its warp's lanes that `want`, after one atomic add (by the first of
// them) on a counter; every lane of the warp must call it.
__device__ __forceinline__ unsigned int warp_append(bool want, unsigned int* counter)
{
    const unsigned int mask = __ballot_sync(FULL, want);
    if (!mask) return 0u;
    const int lane = threadIdx.x & 31, leader = __ffs(mask) - 1;
    unsigned int base = 0u;
    if (lane == leader) base = atomicAdd(counter, (unsigned int)__popc(mask));
    base = __shfl_sync(FULL, base, leader);
    return base + __popc(mask & ((1u << lane) - 1u));
}

// The grid bin of magnitude a: floor(log2(a / floor) * resolution) clipped to [0, points)
// (float32 arithmetic, as the host's log2_bins; the scan and the take compute it alike).
// log2_floor: log2f(floor_f).  The hardware's approximate log2 (2 ulp, one instruction) places
// a within `margin` of its grid position, a bound on both ways' rounding; only where that leaves
// a bin edge in reach is the exact division and log2f computed, which decides alone.
__device__ __forceinline__ int grid_bin(float a, float floor_f, float resolution, int points,
                                        float log2_floor)
{
    const float la = __log2f(a);
    const float f = (la - log2_floor) * resolution;
    float q = floorf(f);
    const float margin = resolution * 1e-6f * (fabsf(la) + fabsf(log2_floor) + 2.0f)
                         + 4e-6f * (fabsf(f) + 1.0f);
    if (!(f - q > margin && q + 1.0f - f > margin)) q = floorf(log2f(a / floor_f) * resolution);
    return q < 0.0f ? 0 : (q > (float)(points - 1) ? points - 1 : (int)q);
}

// A magnitude's bits as an unsigned key: non-negative floats order as their keys.
template<typename T> struct Key;
template<> struct Key<float> {
    typedef unsigned int U;
    __device__ static U of(float v) { return __float_as_uint(v); }
};
template<> struct Key<double> {
    typedef unsigned long long U;
    __device__ static U of(double v) { return (U)__double_as_longlong(v); }
};

// A warp's `count` staged candidates out to (pos, mag) from slot `at` on (slots past cap are
// counted, not written).  A staged slot is round << OFF_BITS | the offset in the warp's chunk of
// that round; the warp's chunk of round 0 starts at w_first, each round `stride` later.
#define OFF_BITS 9
template<typename T>
__device__ __forceinline__ void write_staged(const T* sv, const unsigned int* sa, unsigned int count,
                                             unsigned long long at, long long w_first,
                                             long long stride, long long cap,
                                             long long* __restrict__ pos, T* __restrict__ mag)
{
    for (unsigned int s = threadIdx.x & 31; s < count; s += 32) {
        if (at + s < (unsigned long long)cap) {
            const unsigned int t = sa[s];
            pos[at + s] = w_first + (long long)(t >> OFF_BITS) * stride + (t & ((1u << OFF_BITS) - 1u));
            mag[at + s] = sv[s];
        }
    }
}

// (launch bounds: 4 blocks a multiprocessor, so at most 64 registers a thread; unbounded, the
// compiler took 78 and a multiprocessor held 3)
template<typename T>
__global__ void __launch_bounds__(WARPS * 32, 4)
scan_select(const T* __restrict__ x, long long n, T floor_v, float floor_f, float resolution,
            int points, int store_from, long long cap, long long* __restrict__ pos,
            T* __restrict__ mag, unsigned long long* __restrict__ head,
            unsigned long long* __restrict__ counts)
{
    // head (zero at the start; the last block to finish leaves it zeroed again, so that no
    // memset comes before the next scan): [0] candidates kept (bins >= store_from); [1 + j]
    // candidates in bin j (points > 0); [1 + points] blocks done.  The last block copies
    // [0, 1 + points) to counts.
    constexpr int PL = PER_LANE * 4 / sizeof(T);   // elements a lane reads per round: 64 bytes
    extern __shared__ unsigned int hist[];     // points counters, then one per warp
    __shared__ unsigned long long base;
    __shared__ bool s_last;
    // each warp's stage: the candidates it kept in earlier rounds, then this round's, staged so
    // that all its lanes bin them (a candidate is a few in a hundred elements: binned where found,
    // a warp would run with one lane in 32).  The kept ones go out when a warp's stage is half
    // full and at the end, all the block's with one global atomic (block_reserve: a reservation
    // each round, with its barriers, cost the H200 a fifth of the scan's time)
    __shared__ T st_val[WARPS][32 * PL];
    __shared__ unsigned int st_at[WARPS][32 * PL];
    unsigned int* wsum = hist + points;
    const float log2_floor = log2f(floor_f);
    for (int j = threadIdx.x; j < points; j += blockDim.x) hist[j] = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const unsigned int below = (1u << lane) - 1u;
    T* sv = st_val[wid];
    unsigned int* sa = st_at[wid];
    // a round: each warp takes PL x 32 consecutive elements (as many coalesced loads in
    // flight); the block's rounds are uniform, so every thread reaches the barriers
    const long long tile = (long long)blockDim.x * PL, stride = (long long)gridDim.x * tile;
    const long long mine0 = (long long)wid * (32 * PL) + lane;   // this lane's first in a tile
    const long long w_first = (long long)blockIdx.x * tile + (long long)wid * (32 * PL);
    unsigned int listed = 0;                   // the warp's kept candidates at the front of its stage
    unsigned int r = 0;                        // the round
    // the next round's elements are loaded before this round's are processed (the loads stay in
    // flight through the staging and the block's barriers: without it the scan ran at a quarter
    // of the memory's bandwidth)
    T nx[PL];
    {
        const long long first = (long long)blockIdx.x * tile;
        const bool full = first + tile <= n;   // (a tile inside the array: no bounds per element)
        #pragma unroll
        for (int k = 0; k < PL; ++k) {
            const long long i = first + mine0 + k * 32;
            nx[k] = full || i < n ? x[i] : T(0);
        }
    }
    for (long long start = (long long)blockIdx.x * tile; start < n; start += stride, ++r) {
        const long long w0 = start + (long long)wid * (32 * PL);
        const bool full = start + tile <= n;
        T a[PL];
        #pragma unroll
        for (int k = 0; k < PL; ++k) a[k] = nx[k];
        if (start + stride < n) {
            const bool next_full = start + stride + tile <= n;
            #pragma unroll
            for (int k = 0; k < PL; ++k) {
                const long long i = start + stride + mine0 + k * 32;
                nx[k] = next_full || i < n ? x[i] : T(0);
            }
        }
        unsigned int want = 0;
        #pragma unroll
        for (int k = 0; k < PL; ++k) {
            a[k] = a[k] < T(0) ? -a[k] : a[k];
            if ((full || w0 + k * 32 + lane < n) && a[k] >= floor_v) want |= 1u << k;
        }
        // stage the warp's candidates behind its kept ones: this lane's from its offset among the
        // warp's
        const unsigned int mine = __popc(want);
        const unsigned int incl = warp_scan(mine);
        const unsigned int total = __shfl_sync(FULL, incl, 31);
        if (listed + total > 32 * PL) {       // no room: the warp's kept ones go out now (rare)
            unsigned long long first = 0;
            if (lane == 0) first = atomicAdd(head, (unsigned long long)listed);
            write_staged(sv, sa, listed, __shfl_sync(FULL, first, 0), w_first, stride, cap, pos, mag);
            __syncwarp();
            listed = 0;
        }
        unsigned int at = listed + incl - mine;
        #pragma unroll
        for (int k = 0; k < PL; ++k)
            if ((want >> k) & 1u) { sv[at] = a[k]; sa[at] = (r << OFF_BITS) | (k * 32 + lane); ++at; }
        __syncwarp();
        // bin them with every lane, and compact the kept ones (bins >= store_from) in place
        unsigned int kept = 0;
        for (unsigned int s0 = 0; s0 < total; s0 += 32) {
            const unsigned int s = listed + s0 + lane;
            bool keep = false;
            T v = T(0);
            unsigned int o = 0;
            if (s0 + lane < total) {
                v = sv[s];
                o = sa[s];
                keep = true;
                if (points > 0) {
                    int b = grid_bin((float)v, floor_f, resolution, points, log2_floor);
                    atomicAdd(&hist[b], 1u);
                    keep = b >= store_from;
                }
            }
            __syncwarp();                      // every lane has read before any writes
            const unsigned int m = __ballot_sync(FULL, keep);
            if (keep) { unsigned int d = listed + kept + __popc(m & below); sv[d] = v; sa[d] = o; }
            kept += __popc(m);
            __syncwarp();
        }
        listed += kept;
        if (__syncthreads_or(listed > 16 * PL)) {  // a stage half full: the block's go out
            const unsigned long long first = block_reserve(lane == 0 ? listed : 0u, head, wsum, &base);
            write_staged(sv, sa, listed, __shfl_sync(FULL, first, 0), w_first, stride, cap, pos, mag);
            __syncwarp();
            listed = 0;
        }
    }
    // the rest of the block's kept candidates (block_reserve synchronises the block: the
    // histogram is complete after it)
    const unsigned long long first = block_reserve(lane == 0 ? listed : 0u, head, wsum, &base);
    write_staged(sv, sa, listed, __shfl_sync(FULL, first, 0), w_first, stride, cap, pos, mag);
    for (int j = threadIdx.x; j < points; j += blockDim.x)
        if (hist[j]) atomicAdd(&head[1 + j], (unsigned long long)hist[j]);
    __threadfence();                           // this block's counts, before it counts as done
    __syncthreads();
    if (threadIdx.x == 0)
        s_last = atomicAdd(&head[1 + points], 1ull) == (unsigned long long)(gridDim.x - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int j = threadIdx.x; j <= points; j += blockDim.x) {
        counts[j] = __ldcg(&head[j]);
        head[j] = 0ull;
    }
    if (threadIdx.x == 0) head[1 + points] = 0ull;
}

// Warp 0 of a block (every lane calls it): of the items counted in counts[0, n) (n a multiple of
// 32), the counter holding the need-th from the top, and how many of its items that is (need less
// those above it), to *s_index and *s_need (untouched when fewer than need were counted).  Each
// lane sums n / 32 counters (staggered, so that no two lanes read one bank at a time); the lane
// whose counters hold the need-th is then walked by the whole warp, 32 counters at a time.
__device__ __forceinline__ void warp_find_from_top(const unsigned int* counts, int n, long long need,
                                                   unsigned int* s_index, long long* s_need)
{
    const int ln = threadIdx.x & 31, per = n / 32;
    unsigned int sum = 0u;                     // this lane's counters: n - 1 - per * ln and down
    for (int e = 0; e < per; ++e) sum += counts[n - 1 - per * ln - (e + ln) % per];
    const unsigned int inc = warp_scan(sum);   // this lane's counters and every higher lane's
    const unsigned int holds = __ballot_sync(FULL, (long long)(inc - sum) < need && need <= (long long)inc);
    if (!holds) return;
    const int owner = __ffs(holds) - 1;
    long long run = (long long)__shfl_sync(FULL, inc - sum, owner);
    const int top = n - 1 - per * owner;
    for (int c = 0; c < per; c += 32) {        // the owner's counters from its top, 32 at a time
        const unsigned int v = c + ln < per ? counts[top - c - ln] : 0u;
        const unsigned int in2 = warp_scan(v);
        const unsigned int hit = __ballot_sync(FULL, run + (long long)in2 >= need);
        if (hit) {
            if (ln == __ffs(hit) - 1) { *s_index = top - c - ln; *s_need = need - (run + in2 - v); }
            return;
        }
        run += __shfl_sync(FULL, in2, 31);
    }
}

// The need-th largest offset (key - lo, lo at most the smallest) among the members of a set of
// N keys, by a radix select, 8 bits a round from the span's top bits down (a last round may
// overlap the one before: the digits of the offsets that match the prefix agree with it there).
// Returns it, and in `ties` how many of the members equal to it are taken.  The whole block
// calls it (it synchronises the block).
template<typename U, typename KeyAt, typename Member>
__device__ unsigned long long radix_select(long long N, KeyAt key_at, Member member,
                                           unsigned long long lo, unsigned long long span,
                                           long long need, unsigned int* digits,
                                           unsigned int* s_digit, long long* s_need, long long* ties)
{
    const int bits = span ? 64 - __clzll((long long)span) : 0;
    unsigned long long prefix = 0ull, mask = 0ull;   // high digits of the need-th largest offset
    for (int r = 0; r < (bits + 7) / 8; ++r) {
        const int shift = max(bits - 8 * (r + 1), 0);
        for (int d = threadIdx.x; d < 256; d += blockDim.x) digits[d] = 0u;
        if (threadIdx.x == 0) { *s_digit = 0u; *s_need = 0; }
        __syncthreads();
        for (long long i = threadIdx.x; i < N; i += blockDim.x) {
            const U key = key_at(i);
            if (!member(key)) continue;
            const unsigned long long off = (unsigned long long)key - lo;
            if ((off & mask) == prefix) atomicAdd(&digits[(unsigned int)(off >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) warp_find_from_top(digits, 256, need, s_digit, s_need);
        __syncthreads();
        prefix |= (unsigned long long)*s_digit << shift;
        mask |= 255ull << shift;
        need = *s_need;
        __syncthreads();                       // digits, s_digit and s_need are reset next round
    }
    *ties = need;
    return prefix;
}

// The take's fine bucket of a key: (key - fine_base) >> fine_shift, clipped to [0, FINE)
// (monotonic; the host spreads the boundary bin's key range over the FINE buckets).
__device__ __forceinline__ unsigned int fine_bucket(unsigned long long key, unsigned long long fine_base,
                                                    int fine_shift)
{
    const unsigned long long d = key < fine_base ? 0ull : (key - fine_base) >> fine_shift;
    return d > FINE - 1 ? FINE - 1 : (unsigned int)d;
}

// The take's counters (`heads`): [0] above written, [1] staged, [2] take_boundary's blocks done,
// [3] take_cut's written, [4] the crossing bucket's members listed, [5] take_cut's blocks done,
// [TAKE_FINE_AT, + FINE) the boundary bin's fine histogram.  Zero at the start (the scratch is
// zeroed once, when made); the take's last kernel leaves them zeroed again.
#define TAKE_FINE_AT 8

// The take, first kernel, over the m kept candidates (all of bin j and above among them).  Every
// block writes the positions of those above bin j to out[0, n_above) (and bin j's too when all of
// it is taken), and, when only `take` of bin j's n_at are, stages bin j's (position, key) in
// at_buf (n_at positions, then n_at keys) and counts them in the FINE fine buckets: take_cut
// then takes the largest `take` of them.
template<typename T>
__global__ void __launch_bounds__(TAKE_THREADS)
take_boundary(const long long* __restrict__ pos, const T* __restrict__ mag, long long m,
              float floor_f, float resolution, int points, int j, long long take, long long n_at,
              long long n_above, unsigned long long fine_base, int fine_shift,
              long long* __restrict__ out, long long* __restrict__ at_buf,
              unsigned long long* __restrict__ heads)
{
    typedef typename Key<T>::U U;
    long long* const at_pos = at_buf;
    U* const at_key = reinterpret_cast<U*>(at_buf + n_at);
    __shared__ unsigned int fine[FINE];
    __shared__ unsigned int wsum[32];
    __shared__ unsigned long long base2[2];
    __shared__ bool s_last;
    const bool all_at = take >= n_at, select = take > 0 && !all_at;
    const float log2_floor = log2f(floor_f);
    const long long up_cap = n_above + (all_at ? n_at : 0);
    if (select) {
        for (int d = threadIdx.x; d < FINE; d += blockDim.x) fine[d] = 0u;
        __syncthreads();
    }
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long start = (long long)blockIdx.x * blockDim.x; start < m; start += stride) {
        const long long i = start + threadIdx.x;
        bool up = false, at = false;
        U key = 0;
        long long p = 0;
        if (i < m) {
            const T a = mag[i];
            p = pos[i];                        // with the magnitude: not a wait after the reservation
            const int b = grid_bin((float)a, floor_f, resolution, points, log2_floor);
            up = b > j || (b == j && all_at);
            at = b == j && select;
            key = Key<T>::of(a);
        }
        if (!__syncthreads_or(up || at)) continue;
        unsigned long long s_up, s_at;
        block_reserve2(up, at, &heads[0], &heads[1], wsum, base2, &s_up, &s_at);
        if (up && s_up < (unsigned long long)up_cap) out[s_up] = p;
        if (at && s_at < (unsigned long long)n_at) {
            at_pos[s_at] = p;
            at_key[s_at] = key;
            atomicAdd(&fine[fine_bucket(key, fine_base, fine_shift)], 1u);
        }
    }
    __syncthreads();
    if (select) {                              // take_cut comes next and zeroes the counters
        for (int d = threadIdx.x; d < FINE; d += blockDim.x)
            if (fine[d]) atomicAdd(&heads[TAKE_FINE_AT + d], (unsigned long long)fine[d]);
        return;
    }
    // nothing comes next: the last block to finish zeroes the counters
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&heads[2], 1ull) == (unsigned long long)(gridDim.x - 1);
    __syncthreads();
    if (s_last && threadIdx.x < 3) heads[threadIdx.x] = 0ull;
}

// The take, second kernel (when 0 < take < n_at), over take_boundary's stage: every block finds
// the fine bucket where the count from the top reaches `take` (the cut), writes the stage's
// members of the buckets above it to out[n_above, ...) and lists the cut's members in list_buf
// (at_buf + 2 n_at: positions, then keys); the last block to finish writes the exact largest
// `need` of the cut's members by a radix select and zeroes the counters.  (The pass over the
// stage was take_boundary's last block's alone before: the split saved 0.7 us of the H200's 61.)
static_assert(FINE == 2 * TAKE_THREADS, "take_cut's blocks hold two fine buckets a thread");
#define LIST_CAP 2048
static_assert(RANK_CAP <= LIST_CAP, "take_cut ranks the cut's members in shared memory");
// (launch bounds: one block a multiprocessor, so 64 registers; for two, the compiler took 32 and
// spilled)
template<typename T>
__global__ void __launch_bounds__(TAKE_THREADS, 1)
take_cut(const long long* __restrict__ at_buf, long long n_at, long long take, long long n_above,
         unsigned long long fine_base, int fine_shift, long long* __restrict__ out,
         unsigned long long* __restrict__ heads)
{
    typedef typename Key<T>::U U;
    const long long* const at_pos = at_buf;
    const U* const at_key = reinterpret_cast<const U*>(at_buf + n_at);
    long long* const l_pos = const_cast<long long*>(at_buf) + 2 * n_at;
    U* const l_key = reinterpret_cast<U*>(l_pos + n_at);
    __shared__ unsigned int wsum[32], digits[256];
    __shared__ U s_lkey[LIST_CAP];             // the last block: the cut's members
    __shared__ long long s_lpos[LIST_CAP];     // (and their positions)
    __shared__ unsigned long long base2[2], s_lo_inv, s_hi;
    __shared__ unsigned int s_digit, s_cut_n, s_kept2, s_ties;
    __shared__ long long s_need;
    __shared__ bool s_last;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    // the block's first stage entry is loaded with the counters (one wait on the L2, not two:
    // the stage has n_at slots, so the load needs no count)
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long s_first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    U key = s_first < n_at ? __ldcg(&at_key[s_first]) : U(0);
    long long p = s_first < n_at ? __ldcg(&at_pos[s_first]) : 0ll;
    const long long staged = min((long long)__ldcg(&heads[1]), n_at);
    // the cut, with the whole block: thread t holds buckets FINE - 1 - 2t and FINE - 2 - 2t, a
    // block-wide scan counts those above them
    const int top = FINE - 1 - 2 * (int)threadIdx.x;
    const unsigned int c_hi = (unsigned int)__ldcg(&heads[TAKE_FINE_AT + top]);
    const unsigned int c_lo = (unsigned int)__ldcg(&heads[TAKE_FINE_AT + top - 1]);
    const unsigned int incl = warp_scan(c_hi + c_lo);
    if (lane == 31) wsum[wid] = incl;
    if (threadIdx.x == 0) { s_digit = 0u; s_need = 0; s_cut_n = 0u; }
    __syncthreads();
    if (wid == 0) { const unsigned int w = wsum[lane]; wsum[lane] = warp_scan(w) - w; }
    __syncthreads();
    {
        const long long above = (long long)wsum[wid] + (long long)(incl - c_hi - c_lo);
        if (above < take && take <= above + (long long)c_hi) {
            s_digit = (unsigned int)top; s_need = take - above; s_cut_n = c_hi;
        } else if (above + (long long)c_hi < take && take <= above + (long long)(c_hi + c_lo)) {
            s_digit = (unsigned int)(top - 1); s_need = take - above - (long long)c_hi; s_cut_n = c_lo;
        }
    }
    __syncthreads();
    const unsigned int cut = s_digit;          // the crossing bucket
    const long long need = s_need;             // how many of its members are taken
    const bool whole = need >= (long long)s_cut_n;
    // (every thread has read wsum before the barrier above: block_reserve2 may reuse it)
    for (long long start = (long long)blockIdx.x * blockDim.x; start < staged; start += stride) {
        const long long s = start + threadIdx.x;
        bool keep = false, member = false;
        if (s < staged) {
            if (s != s_first) {
                key = __ldcg(&at_key[s]);
                p = __ldcg(&at_pos[s]);
            }
            const unsigned int d = fine_bucket(key, fine_base, fine_shift);
            keep = d > cut || (d == cut && whole);
            member = d == cut && !whole;
        }
        if (!__syncthreads_or(keep || member)) continue;
        unsigned long long f_keep, f_mem;
        block_reserve2(keep, member, &heads[3], &heads[4], wsum, base2, &f_keep, &f_mem);
        if (keep && f_keep < (unsigned long long)take) out[n_above + f_keep] = p;
        if (member && f_mem < (unsigned long long)n_at) { l_pos[f_mem] = p; l_key[f_mem] = key; }
    }
    __threadfence();                           // this block's writes, before it counts as done
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&heads[5], 1ull) == (unsigned long long)(gridDim.x - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const long long N = whole ? 0 : min((long long)__ldcg(&heads[4]), n_at);
    if (N && N <= RANK_CAP) {
        // the need largest of the cut's few members (a few tens, typically): each member's rank
        // among them, by magnitude and then by list order, counted against all of them in shared
        // memory (one barrier, where the radix select below takes four a round, a round a byte:
        // 2.1 us less of the H200's 60.7 for the whole selection)
        for (int i = threadIdx.x; i < (int)N; i += blockDim.x) {
            s_lkey[i] = __ldcg(&l_key[i]);
            s_lpos[i] = __ldcg(&l_pos[i]);
        }
        __syncthreads();
        const long long first = n_above + take - need;
        for (int i = threadIdx.x; i < (int)N; i += blockDim.x) {
            const U k = s_lkey[i];
            int rank = 0;
            for (int e = 0; e < (int)N; ++e) {
                const U o = s_lkey[e];
                rank += o > k || (o == k && e < i);
            }
            if (rank < need) out[first + rank] = s_lpos[i];
        }
    } else if (N) {
        // the need largest of the cut's members, by a radix select over their offsets from the
        // smallest; the members are read once, into shared memory (unless more than LIST_CAP:
        // then from the list each time)
        const bool listed = N <= LIST_CAP;
        if (threadIdx.x == 0) { s_hi = 0ull; s_lo_inv = 0ull; s_kept2 = 0u; s_ties = 0u; }
        __syncthreads();
        for (long long i = threadIdx.x; i < N; i += blockDim.x) {
            const U k = __ldcg(&l_key[i]);
            if (listed) { s_lkey[i] = k; s_lpos[i] = __ldcg(&l_pos[i]); }
            atomicMax(&s_hi, (unsigned long long)k);
            atomicMax(&s_lo_inv, ~(unsigned long long)k);
        }
        __syncthreads();
        auto key_at = [&](long long i) -> U { return listed ? s_lkey[i] : __ldcg(&l_key[i]); };
        auto any = [](U) -> bool { return true; };
        const unsigned long long lo = ~s_lo_inv;
        long long ties = 0;
        const unsigned long long kth = radix_select<U>(N, key_at, any, lo, s_hi - lo, need,
                                                       digits, &s_digit, &s_need, &ties);
        const long long first = n_above + take - need, larger = need - ties;
        for (long long i0 = 0; i0 < N; i0 += blockDim.x) {
            const long long i = i0 + threadIdx.x;
            bool keep = false, tie = false;
            if (i < N) {
                const unsigned long long off = (unsigned long long)key_at(i) - lo;
                keep = off > kth;
                tie = off == kth;
            }
            const long long p = (keep || tie) ? (listed ? s_lpos[i] : __ldcg(&l_pos[i])) : 0ll;
            const unsigned int slot = warp_append(keep, &s_kept2);
            const unsigned int tslot = warp_append(tie, &s_ties);
            if (keep && (long long)slot < larger) out[first + slot] = p;
            if (tie && (long long)tslot < ties) out[first + larger + tslot] = p;
        }
    }
    __syncthreads();                           // every block has read the counters
    if (threadIdx.x < TAKE_FINE_AT) heads[threadIdx.x] = 0ull;
    for (int d = threadIdx.x; d < FINE; d += blockDim.x) heads[TAKE_FINE_AT + d] = 0ull;
}
