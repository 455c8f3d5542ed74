// How DRAM bandwidth divides between a copy on some SMs (an emulated slice's client) and a streaming
// neighbour on the others, for several neighbour kernels (evict-first or plain copies, reads only,
// writes only, bulk copies by the Tensor Memory Accelerator). Three ways, run by
// benches/memory_contention.sh on the GPU machine:
//   memory_contention inkernel                 one kernel fills every SM and each block takes its role
//                                              from the SM it landed on: the arbitration, no MPS
//   memory_contention client|client_roles N D  an MPS client on N SMs (held by the percentage MPS was
//                                              given, or at 100 % on the SMs whose ids are 0..N-1):
//                                              copies alone, then beside the neighbour; D is the folder
//                                              the two processes meet in
//   memory_contention neighbour KIND D         the neighbour, a second MPS client at 100 %, keeping
//                                              off the client's SMs: those with the client's ids
//                                              (D/sms), its own highest ids (D/top), or those it
//                                              cannot place blocks on while the client fills its own
//                                              (D/footprint)
// Bandwidth counts reads and writes. The findings are in benches/results/*-slice-fidelity.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <unistd.h>

#define CHECK(x)                                                                         \
    do {                                                                                 \
        cudaError_t e = (x);                                                             \
        if (e != cudaSuccess) {                                                          \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

enum Role : unsigned char { IDLE = 0, CLIENT = 1, NEIGHBOUR = 2 };

// The neighbour kernels compared.
enum Kind { COPY_CS8, READ_CS8, WRITE_CS8, COPY_PLAIN8, READ_CS16, TMA_READ, TMA_COPY, KINDS };
static const char* KIND_NAMES[KINDS] = {"copy_cs8", "read_cs8", "write_cs8", "copy_plain8",
                                        "read_cs16", "tma_read", "tma_copy"};

struct Params {
    const float4* csrc;
    float4* cdst;
    unsigned long long cn;  // float4 in each client buffer
    const float4* nsrc;
    float4* ndst;
    unsigned long long nchunks;  // neighbour chunks of CHUNK bytes in each buffer
    const unsigned char* role;   // per SM id
    unsigned long long* start;   // the first block's start time
    unsigned long long* bytes;   // per role, moved within the window
    unsigned long long* sm_bytes;  // per SM id
    unsigned* client_rank;
    unsigned long long* chunk;   // the neighbour's next chunk
    unsigned client_blocks;      // the client's blocks (for its grid stride)
    unsigned long long warm_ns, window_ns;
};

constexpr unsigned THREADS = 256;
constexpr unsigned CHUNK = 32768;  // bytes of an LSU neighbour's chunk: 8 float4 per thread
constexpr unsigned TMA_STAGE = 8192;
constexpr unsigned TMA_STAGES = 3;

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned sm_id() {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

// The client: the probe's grid-stride copy, four loads in flight per thread, plain loads and stores.
__device__ void client(const Params& p, unsigned long long t1, unsigned long long t2, unsigned long long& moved) {
    __shared__ unsigned rank;
    if (threadIdx.x == 0) rank = atomicAdd(p.client_rank, 1u);
    __syncthreads();
    unsigned long long stride = (unsigned long long)p.client_blocks * THREADS;
    unsigned long long i = (unsigned long long)rank * THREADS + threadIdx.x;
    for (;;) {
        unsigned long long a0 = i % p.cn, a1 = (i + stride) % p.cn, a2 = (i + 2 * stride) % p.cn,
                           a3 = (i + 3 * stride) % p.cn;
        float4 a = p.csrc[a0], b = p.csrc[a1], c = p.csrc[a2], d = p.csrc[a3];
        p.cdst[a0] = a; p.cdst[a1] = b; p.cdst[a2] = c; p.cdst[a3] = d;
        i += 4 * stride;
        unsigned long long t = now_ns();
        if (t >= t1 && t < t2) moved += 4 * 2 * 16;
        if (t >= t2) return;
    }
}

template <int K>
__device__ void neighbour_lsu(const Params& p, unsigned long long t1, unsigned long long t2, unsigned long long& moved) {
    __shared__ unsigned long long taken;
    constexpr int LOADS = K == READ_CS16 ? 16 : 8;
    constexpr unsigned PER_CHUNK = LOADS * THREADS;  // float4
    unsigned long long chunks = p.nchunks * (CHUNK / 16) / PER_CHUNK;
    float acc = 0.f;
    for (;;) {
        __syncthreads();
        if (threadIdx.x == 0) taken = atomicAdd(p.chunk, 1ull) % chunks;
        __syncthreads();
        const float4* from = p.nsrc + taken * PER_CHUNK + threadIdx.x;
        float4* to = p.ndst + taken * PER_CHUNK + threadIdx.x;
        float4 v[LOADS];
        if (K == WRITE_CS8) {
#pragma unroll
            for (int k = 0; k < LOADS; k++) __stcs(to + k * THREADS, make_float4(acc, acc, acc, acc));
        } else {
#pragma unroll
            for (int k = 0; k < LOADS; k++) v[k] = K == COPY_PLAIN8 ? from[k * THREADS] : __ldcs(from + k * THREADS);
            if (K == COPY_CS8 || K == COPY_PLAIN8) {
#pragma unroll
                for (int k = 0; k < LOADS; k++) {
                    if (K == COPY_PLAIN8) to[k * THREADS] = v[k];
                    else __stcs(to + k * THREADS, v[k]);
                }
            } else {
#pragma unroll
                for (int k = 0; k < LOADS; k++) acc += v[k].x + v[k].y + v[k].z + v[k].w;
            }
        }
        unsigned long long t = now_ns();
        bool copies = K == COPY_CS8 || K == COPY_PLAIN8;
        if (t >= t1 && t < t2) moved += (unsigned long long)LOADS * 16 * (copies ? 2 : 1);
        if (t >= t2) break;
    }
    if (acc == 12345.f) p.ndst[0] = make_float4(acc, acc, acc, acc);
}

// Bulk copies (the Tensor Memory Accelerator): one thread keeps TMA_STAGES loads of TMA_STAGE bytes
// in flight into shared memory, evict-first in L2; TMA_COPY writes each back out with a bulk store.
template <int K>
__device__ void neighbour_tma(const Params& p, unsigned long long t1, unsigned long long t2, unsigned long long& moved) {
    extern __shared__ __align__(128) unsigned char stage[];
    __shared__ __align__(8) unsigned long long bar[TMA_STAGES];
    if (threadIdx.x != 0) return;
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (unsigned s = 0; s < TMA_STAGES; s++) {
        unsigned a = (unsigned)__cvta_generic_to_shared(&bar[s]);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    unsigned long long stage_chunks = p.nchunks * (CHUNK / TMA_STAGE);
    unsigned long long at[TMA_STAGES];
    auto issue = [&](unsigned s) {
        unsigned long long c = atomicAdd(p.chunk, 1ull) % stage_chunks;
        at[s] = c;
        unsigned a = (unsigned)__cvta_generic_to_shared(&bar[s]);
        unsigned dst = (unsigned)__cvta_generic_to_shared(stage + s * TMA_STAGE);
        const unsigned char* src = (const unsigned char*)p.nsrc + c * TMA_STAGE;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(TMA_STAGE) : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(dst),
            "l"(src), "r"(TMA_STAGE), "r"(a), "l"(policy)
            : "memory");
    };
    for (unsigned s = 0; s < TMA_STAGES; s++) issue(s);
    auto wait = [&](unsigned s, unsigned parity) {
        unsigned a = (unsigned)__cvta_generic_to_shared(&bar[s]);
        unsigned ok = 0;
        while (!ok) {
            asm volatile(
                "{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                : "=r"(ok)
                : "r"(a), "r"(parity)
                : "memory");
        }
    };
    for (unsigned phase = 0;; phase ^= 1) {
        for (unsigned s = 0; s < TMA_STAGES; s++) {
            wait(s, phase);
            if (K == TMA_COPY) {
                unsigned src = (unsigned)__cvta_generic_to_shared(stage + s * TMA_STAGE);
                unsigned char* dst = (unsigned char*)p.ndst + at[s] * TMA_STAGE;
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;" ::"l"(dst),
                             "r"(src), "r"(TMA_STAGE), "l"(policy)
                             : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            }
            unsigned long long t = now_ns();
            if (t >= t1 && t < t2) moved += TMA_STAGE * (K == TMA_COPY ? 2 : 1);
            if (t >= t2) {
                // The other stages still have a load in flight: those before this one issued in this
                // pass (the next parity), those after it in the last.
                for (unsigned u = 0; u < TMA_STAGES; u++)
                    if (u != s) wait(u, u < s ? phase ^ 1 : phase);
                if (K == TMA_COPY) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
                return;
            }
            issue(s);
        }
    }
}

template <int K>
__global__ void __launch_bounds__(THREADS) contend(Params p) {
    __shared__ unsigned char my_role;
    __shared__ unsigned long long t0;
    unsigned sm = sm_id();
    if (threadIdx.x == 0) {
        my_role = p.role[sm & 255];
        unsigned long long t = now_ns();
        unsigned long long old = atomicCAS(p.start, 0ull, t);
        t0 = old == 0 ? t : old;
    }
    __syncthreads();
    if (my_role == IDLE) return;
    unsigned long long t1 = t0 + p.warm_ns, t2 = t1 + p.window_ns;
    unsigned long long moved = 0;
    if (my_role == CLIENT) client(p, t1, t2, moved);
    else if (K == TMA_READ || K == TMA_COPY) neighbour_tma<K>(p, t1, t2, moved);
    else neighbour_lsu<K>(p, t1, t2, moved);
    if (moved) {
        atomicAdd(&p.bytes[my_role], moved);
        atomicAdd(&p.sm_bytes[sm & 255], moved);
    }
}

// Multiply-adds and no memory, for `iters` rounds: fills the SMs it runs on (8 blocks of 256 threads
// each, every thread slot) for as long as it runs.
__global__ void __launch_bounds__(THREADS) occupy(float* sink, unsigned iters, unsigned* used) {
    if (used && threadIdx.x == 0) atomicAdd(&used[sm_id() & 255], 1u);
    float a = threadIdx.x, b = a + 1.f, c = a + 2.f, d = a + 3.f;
    for (unsigned i = 0; i < iters; i++) {
        a = fmaf(a, 0.9999f, 0.5f); b = fmaf(b, 0.9999f, 0.5f); c = fmaf(c, 0.9999f, 0.5f); d = fmaf(d, 0.9999f, 0.5f);
    }
    if (a + b + c + d == -1.f) sink[0] = a;
}

// Each block notes the SM it ran on, after a few microseconds' wait.
__global__ void where(unsigned* hits) {
    if (threadIdx.x == 0) {
        atomicAdd(&hits[sm_id() & 255], 1u);
        unsigned long long t = now_ns();
        while (now_ns() < t + 5000) {
        }
    }
}

template <int K>
static void* kernel_of() {
    return (void*)contend<K>;
}

struct Result {
    double client_gbps, neighbour_gbps;
};

struct Bench {
    int sms;
    Params p;
    unsigned long long *start, *bytes, *sm_bytes, *chunk;
    unsigned* rank;
    unsigned char* role_d;
    std::vector<void*> kernels;
    std::vector<int> per_sm;

    // One launch: `grid_sms` SMs' worth of blocks (0: every SM), each block's role by its SM.
    Result run(int kind, const std::vector<unsigned char>& role, double window_ms, int grid_sms = 0,
               double warm_ms = 2.0) {
        CHECK(cudaMemcpy(role_d, role.data(), 256, cudaMemcpyHostToDevice));
        CHECK(cudaMemset(start, 0, 8));
        CHECK(cudaMemset(bytes, 0, 3 * 8));
        CHECK(cudaMemset(sm_bytes, 0, 256 * 8));
        CHECK(cudaMemset(rank, 0, 4));
        CHECK(cudaMemset(chunk, 0, 8));
        int clients = 0;
        for (int s = 0; s < sms; s++) clients += role[s] == CLIENT;
        p.client_blocks = std::max(1, clients * per_sm[kind]);
        p.warm_ns = (unsigned long long)(warm_ms * 1e6);
        p.window_ns = (unsigned long long)(window_ms * 1e6);
        size_t smem = (kind == TMA_READ || kind == TMA_COPY) ? TMA_STAGES * TMA_STAGE : 0;
        void* args[] = {&p};
        if (grid_sms > 0) p.client_blocks = grid_sms * per_sm[kind];
        int grid = (grid_sms > 0 ? grid_sms : sms) * per_sm[kind];
        CHECK(cudaLaunchKernel(kernels[kind], dim3(grid), dim3(THREADS), args, smem, 0));
        CHECK(cudaDeviceSynchronize());
        unsigned long long b[3];
        CHECK(cudaMemcpy(b, bytes, sizeof b, cudaMemcpyDeviceToHost));
        double s = window_ms * 1e-3;
        return {b[CLIENT] / s / 1e9, b[NEIGHBOUR] / s / 1e9};
    }

    // The last launch's GB/s per busy SM: min, median, max.
    std::string per_sm_gbps(double window_ms) {
        unsigned long long per[256];
        CHECK(cudaMemcpy(per, sm_bytes, sizeof per, cudaMemcpyDeviceToHost));
        std::vector<double> g;
        for (int s = 0; s < 256; s++)
            if (per[s]) g.push_back(per[s] / (window_ms * 1e-3) / 1e9);
        if (g.empty()) return "none";
        std::sort(g.begin(), g.end());
        char buf[96];
        snprintf(buf, sizeof buf, "%zu SMs at %.1f/%.1f/%.1f GB/s", g.size(), g.front(), g[g.size() / 2], g.back());
        return buf;
    }

    // The SMs the last launch moved bytes on.
    std::vector<int> busy_sms() {
        unsigned long long per[256];
        CHECK(cudaMemcpy(per, sm_bytes, sizeof per, cudaMemcpyDeviceToHost));
        std::vector<int> ids;
        for (int s = 0; s < 256; s++)
            if (per[s]) ids.push_back(s);
        return ids;
    }
};

// "0-15,32-47": a list of SM ids as ranges.
static std::string ranges(const std::vector<int>& ids) {
    std::string out;
    for (size_t i = 0; i < ids.size();) {
        size_t j = i;
        while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) j++;
        out += (out.empty() ? "" : ",") + std::to_string(ids[i]) + (j > i ? "-" + std::to_string(ids[j]) : "");
        i = j + 1;
    }
    return out;
}

static bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Under MPS (the script sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): copies alone, writes the SMs it ran
// on to DIR/sms, waits for DIR/ready (the neighbour streaming), copies beside it, writes DIR/done.
static int client_mode(Bench& b, int sms, const std::string& dir, bool by_role) {
    std::vector<unsigned char> all(256, CLIENT);
    if (by_role) {
        std::fill(all.begin(), all.end(), IDLE);
        for (int s = 0; s < sms; s++) all[s] = CLIENT;
    }
    int grid_sms = by_role ? 0 : sms;
    std::vector<double> alone, beside;
    std::vector<int> seen(256, 0);
    for (int r = 0; r < 7; r++) {
        alone.push_back(b.run(COPY_CS8, all, 20.0, grid_sms, 1.0).client_gbps);
        for (int id : b.busy_sms()) seen[id] = 1;
    }
    std::string list;
    int count = 0;
    for (int s = 0; s < 256; s++)
        if (seen[s]) list += (count++ ? "," : "") + std::to_string(s);
    FILE* f = fopen((dir + "/sms.tmp").c_str(), "w");
    fprintf(f, "%s\n", list.c_str());
    fclose(f);
    rename((dir + "/sms.tmp").c_str(), (dir + "/sms").c_str());
    // Fill the SMs while the neighbour finds which of its SMs are left: ~300 ms of multiply-adds.
    float* sink;
    CHECK(cudaMalloc(&sink, 4));
    auto compute_ms = [&](unsigned iters) {
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        cudaEventRecord(e0);
        occupy<<<sms * 8, THREADS>>>(sink, iters, nullptr);
        cudaEventRecord(e1);
        CHECK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        return (double)ms;
    };
    std::vector<double> fma_alone;
    for (int r = 0; r < 5; r++) fma_alone.push_back(compute_ms(20000));
    if (exists(dir + "/footprint")) {
        unsigned* used;
        CHECK(cudaMalloc(&used, 1024));
        CHECK(cudaMemset(used, 0, 1024));
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        cudaEventRecord(e0);
        occupy<<<sms * 8, THREADS>>>(sink, 3000000, used);
        cudaEventRecord(e1);
        fclose(fopen((dir + "/occupying").c_str(), "w"));
        CHECK(cudaDeviceSynchronize());
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        unsigned u[256];
        CHECK(cudaMemcpy(u, used, sizeof u, cudaMemcpyDeviceToHost));
        std::vector<int> ids;
        for (int s = 0; s < 256; s++)
            if (u[s]) ids.push_back(s);
        printf("occupied %.0f ms on SMs %s; ", ms, ranges(ids).c_str());
    }
    for (int i = 0; i < 3000 && !exists(dir + "/ready"); i++) usleep(10000);
    if (!exists(dir + "/ready")) {
        fprintf(stderr, "no neighbour\n");
        return 1;
    }
    usleep(200000);
    std::vector<int> beside_seen(256, 0);
    for (int r = 0; r < 15; r++) {
        beside.push_back(b.run(COPY_CS8, all, 40.0, grid_sms, 1.0).client_gbps);
        for (int id : b.busy_sms()) beside_seen[id] = 1;
    }
    std::vector<double> fma_beside;
    for (int r = 0; r < 5; r++) fma_beside.push_back(compute_ms(20000));
    int moved = 0;
    for (int s = 0; s < 256; s++) moved += beside_seen[s] && !seen[s];
    FILE* d = fopen((dir + "/done").c_str(), "w");
    fclose(d);
    std::vector<int> ids;
    for (int s = 0; s < 256; s++)
        if (seen[s]) ids.push_back(s);
    printf("compute probe %.3f ms alone, %.3f beside (%+.1f %%); ", median(fma_alone), median(fma_beside),
           (median(fma_beside) / median(fma_alone) - 1) * 100);
    printf("client on SMs %s (%d more beside; %s): alone %.0f GB/s, beside %.0f GB/s (min %.0f, max %.0f)\n", ranges(ids).c_str(), moved,
           b.per_sm_gbps(40.0).c_str(), median(alone), median(beside), *std::min_element(beside.begin(), beside.end()),
           *std::max_element(beside.begin(), beside.end()));
    return 0;
}

// Under MPS at 100 %: streams with KIND on every SM but the client's (read from DIR/sms), touching
// DIR/ready after its first launch, until DIR/done appears.
static int neighbour_mode(Bench& b, int kind, const std::string& dir) {
    for (int i = 0; i < 3000 && !exists(dir + "/sms"); i++) usleep(10000);
    std::vector<unsigned char> role(256, NEIGHBOUR);
    if (exists(dir + "/footprint")) {
        // The client's SMs in this process's numbering: those its blocks cannot land on while the
        // client fills its own.
        for (int i = 0; i < 3000 && !exists(dir + "/occupying"); i++) usleep(1000);
        usleep(20000);
        unsigned* hits;
        CHECK(cudaMalloc(&hits, 256 * 4));
        CHECK(cudaMemset(hits, 0, 256 * 4));
        where<<<b.sms * 16, 32>>>(hits);
        CHECK(cudaDeviceSynchronize());
        unsigned h[256];
        CHECK(cudaMemcpy(h, hits, sizeof h, cudaMemcpyDeviceToHost));
        std::vector<int> left;
        std::vector<unsigned> counts;
        for (int s = 0; s < 256; s++) {
            if (s >= b.sms || !h[s]) role[s] = IDLE;
            else left.push_back(s);
            if (s < b.sms) counts.push_back(h[s]);
        }
        std::sort(counts.begin(), counts.end());
        fprintf(stderr, "footprint: blocks per SM %u/%u/%u\n", counts.front(), counts[counts.size() / 2], counts.back());
        fprintf(stderr, "footprint: %zu SMs left to the neighbour: %s\n", left.size(), ranges(left).c_str());
    } else if (exists(dir + "/top")) {
        // The client's SMs taken as this process's highest ids.
        FILE* f = fopen((dir + "/sms").c_str(), "r");
        int id, n = 0;
        while (fscanf(f, "%d,", &id) == 1) n++;
        fclose(f);
        for (int s = b.sms - n; s < 256; s++) role[s] = IDLE;
    } else {
        FILE* f = fopen((dir + "/sms").c_str(), "r");
        if (!f) return 1;
        int id;
        while (fscanf(f, "%d,", &id) == 1) role[id & 255] = IDLE;
        fclose(f);
    }
    // Alone first (the client waits for `ready`), then beside the client until it is done.
    std::vector<double> alone, gbps;
    for (int i = 0; i < 40; i++) alone.push_back(b.run(kind, role, 5.0, 0, 0.0).neighbour_gbps);
    std::string alone_sms = b.per_sm_gbps(5.0);
    fclose(fopen((dir + "/ready").c_str(), "w"));
    std::vector<int> ran;
    for (int i = 0; i < 2000 && !exists(dir + "/done"); i++) {
        gbps.push_back(b.run(kind, role, 5.0, 0, 0.0).neighbour_gbps);
        if (i == 20) ran = b.busy_sms();
    }
    std::string beside_sms = b.per_sm_gbps(5.0);
    printf("neighbour %s on SMs %s: alone %.0f GB/s (%s), beside %.0f GB/s (%s)\n", KIND_NAMES[kind], ranges(ran).c_str(),
           median(alone), alone_sms.c_str(), median(gbps), beside_sms.c_str());
    return 0;
}

int main(int argc, char** argv) {
    std::string mode = argc > 1 ? argv[1] : "inkernel";
    double window_ms = 20.0;
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    Bench b;
    b.sms = prop.multiProcessorCount;
    printf("# %s, %d SMs, L2 %d MiB, window %.0f ms\n", prop.name, b.sms, prop.l2CacheSize >> 20, window_ms);
    const size_t BYTES = 512ull << 20;
    float4 *cs, *cd, *ns, *nd;
    CHECK(cudaMalloc(&cs, BYTES));
    CHECK(cudaMalloc(&cd, BYTES));
    CHECK(cudaMalloc(&ns, BYTES));
    CHECK(cudaMalloc(&nd, BYTES));
    CHECK(cudaMemset(cs, 0, BYTES));
    CHECK(cudaMemset(ns, 0, BYTES));
    CHECK(cudaMalloc(&b.start, 8));
    CHECK(cudaMalloc(&b.bytes, 3 * 8));
    CHECK(cudaMalloc(&b.sm_bytes, 256 * 8));
    CHECK(cudaMalloc(&b.chunk, 8));
    CHECK(cudaMalloc(&b.rank, 4));
    CHECK(cudaMalloc(&b.role_d, 256));
    b.p = Params{cs, cd, BYTES / 16, ns, nd, BYTES / CHUNK, b.role_d, b.start, b.bytes, b.sm_bytes, b.rank, b.chunk, 0, 0, 0};
    b.kernels = {kernel_of<COPY_CS8>(), kernel_of<READ_CS8>(), kernel_of<WRITE_CS8>(), kernel_of<COPY_PLAIN8>(),
                 kernel_of<READ_CS16>(), kernel_of<TMA_READ>(), kernel_of<TMA_COPY>()};
    printf("# blocks of %u threads per SM:", THREADS);
    for (int k = 0; k < KINDS; k++) {
        int n = 0;
        size_t smem = (k == TMA_READ || k == TMA_COPY) ? TMA_STAGES * TMA_STAGE : 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, b.kernels[k], THREADS, smem));
        cudaFuncAttributes attr;
        CHECK(cudaFuncGetAttributes(&attr, b.kernels[k]));
        b.per_sm.push_back(n);
        printf(" %s %d (%d regs)", KIND_NAMES[k], n, attr.numRegs);
    }
    printf("\n");
    if (mode == "client") return client_mode(b, atoi(argv[2]), argv[3], false);
    if (mode == "client_roles") return client_mode(b, atoi(argv[2]), argv[3], true);
    if (mode == "neighbour") {
        for (int k = 0; k < KINDS; k++)
            if (std::string(argv[2]) == KIND_NAMES[k]) return neighbour_mode(b, k, argv[3]);
        return 2;
    }

    // Whole-GPU copy bandwidth: the client on every SM.
    std::vector<unsigned char> all(256, IDLE);
    for (int s = 0; s < b.sms; s++) all[s] = CLIENT;
    double full = 0;
    for (int r = 0; r < 3; r++) full = std::max(full, b.run(COPY_CS8, all, window_ms).client_gbps);
    printf("# the client's copy on all %d SMs: %.0f GB/s\n", b.sms, full);
    printf("%-6s %-7s %-12s %9s %9s %9s %9s %7s\n", "sms", "chosen", "neighbour", "alone", "beside", "share",
           "ratio", "nb GB/s");

    struct Slice {
        const char* name;
        int sms;
        double memory;
    };
    Slice slices[] = {{"1g", 16, 1.0 / 8}, {"2g", 32, 2.0 / 8}, {"3g", 60, 4.0 / 8}, {"4g", 64, 4.0 / 8}};
    for (auto& sl : slices) {
        for (int spread = 0; spread < 2; spread++) {
            std::vector<unsigned char> alone(256, IDLE), both(256, IDLE);
            for (int s = 0; s < b.sms; s++) both[s] = NEIGHBOUR;
            for (int i = 0; i < sl.sms; i++) {
                int s = spread ? (int)((long)i * b.sms / sl.sms) : i;
                alone[s] = CLIENT;
                both[s] = CLIENT;
            }
            double a = 0;
            for (int r = 0; r < 3; r++) a = std::max(a, b.run(COPY_CS8, alone, window_ms).client_gbps);
            double share = sl.memory * full;
            for (int k = 0; k < KINDS; k++) {
                std::vector<double> c, n;
                for (int r = 0; r < 3; r++) {
                    Result x = b.run(k, both, window_ms);
                    c.push_back(x.client_gbps);
                    n.push_back(x.neighbour_gbps);
                }
                std::sort(c.begin(), c.end());
                std::sort(n.begin(), n.end());
                printf("%-2s/%-3d %-7s %-12s %9.0f %9.0f %9.0f %9.2f %7.0f\n", sl.name, sl.sms, spread ? "spread" : "low",
                       KIND_NAMES[k], a, c[1], share, c[1] / share, n[1]);
                fflush(stdout);
            }
        }
    }
    // The neighbour alone on the SMs a 3g leaves, each kind.
    std::vector<unsigned char> rest(256, IDLE);
    for (int s = 60; s < b.sms; s++) rest[s] = NEIGHBOUR;
    for (int k = 0; k < KINDS; k++) {
        Result x = b.run(k, rest, window_ms);
        printf("# %s alone on %d SMs: %.0f GB/s\n", KIND_NAMES[k], b.sms - 60, x.neighbour_gbps);
    }
    return 0;
}
