// Collectives between the ranks of one machine through a shared-memory segment
// (distributed.py's "shm" transport): all-reduce (float32 sum), all-gather and broadcast.
//
// Layout of the segment (made by rank 0, mapped by every rank):
//
//   [ header page ][ flags: one cache line pair per rank ][ buffer 0: a slot per rank ][ buffer 1 ]
//
// Every collective moves at most a slot's bytes per rank at a time (larger payloads go in
// chunks); each chunk is one sequence number `seq`, the same on every rank, and uses
// buffer seq & 1. A rank publishes flags[r] = seq (release) once it has written its part of
// chunk seq, which also says it has finished reading chunk seq - 1. So a rank about to write
// buffer seq & 1 waits until every rank has published seq - 1 (they are done with chunk
// seq - 2, the buffer's last use): ranks are never more than one chunk apart.
//
// Waiting spins a short while (the peer is usually a few microseconds behind), then yields,
// then sleeps in growing naps (an idle rank > 0 waiting for rank 0's next step burns no
// core). While it sleeps it checks the deadline and that the ranks it waits for are alive:
// each rank holds a POSIX lock on byte `rank` of the segment's file, released by the kernel
// when the process exits however it exits.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace {

constexpr int64_t kHeaderBytes = 4096;
constexpr int64_t kFlagBytes = 128;  // two cache lines: no false sharing, even with prefetch
constexpr int64_t kSpinNs = 50'000;
constexpr int64_t kYieldNs = 2'000'000;
constexpr int64_t kMaxNapNs = 1'000'000;

enum Status { kOk = 0, kTimeout = 1, kGone = 2, kBroken = 3 };

struct Group {
    char* base;
    int64_t size;
    int fd;
    int rank;
    int world;
    int64_t slot_bytes;
    uint64_t seq;
    bool broken;
};

int64_t now_ns() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1'000'000'000LL + t.tv_nsec;
}

int64_t flags_bytes(int world) {
    int64_t bytes = world * kFlagBytes;
    return (bytes + 4095) / 4096 * 4096;
}

std::atomic<uint64_t>& flag(Group* g, int rank) {
    return *reinterpret_cast<std::atomic<uint64_t>*>(g->base + kHeaderBytes + rank * kFlagBytes);
}

char* slot(Group* g, uint64_t seq, int rank) {
    char* data = g->base + kHeaderBytes + flags_bytes(g->world);
    return data + ((seq & 1) * g->world + rank) * g->slot_bytes;
}

bool alive(Group* g, int rank) {
    struct flock lock = {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    lock.l_start = rank;
    lock.l_len = 1;
    if (fcntl(g->fd, F_GETLK, &lock) != 0) return true;  // cannot tell: the deadline decides
    return lock.l_type != F_UNLCK;
}

// Wait until `rank` has published `target`; kTimeout past `deadline`, kGone if it exited.
int wait_for(Group* g, int rank, uint64_t target, int64_t deadline, int* who) {
    std::atomic<uint64_t>& f = flag(g, rank);
    if (f.load(std::memory_order_acquire) >= target) return kOk;
    const int64_t start = now_ns();
    int64_t nap = 20'000;
    for (uint64_t i = 1;; ++i) {
        if (f.load(std::memory_order_acquire) >= target) return kOk;
        if (i % 64) {
            CPU_RELAX();
            continue;
        }
        const int64_t now = now_ns();
        const int64_t waited = now - start;
        if (waited < kSpinNs) continue;
        if (waited < kYieldNs) {
            sched_yield();
            continue;
        }
        if (f.load(std::memory_order_acquire) >= target) return kOk;
        if (now > deadline || !alive(g, rank)) {
            if (f.load(std::memory_order_acquire) >= target) return kOk;
            *who = rank;
            g->broken = true;
            return now > deadline ? kTimeout : kGone;
        }
        timespec t = {0, static_cast<long>(nap)};
        nanosleep(&t, nullptr);
        nap = nap * 2 > kMaxNapNs ? kMaxNapNs : nap * 2;
    }
}

int wait_all(Group* g, uint64_t target, int64_t deadline, int* who) {
    for (int r = 0; r < g->world; ++r) {
        if (r == g->rank) continue;
        if (int s = wait_for(g, r, target, deadline, who)) return s;
    }
    return kOk;
}

int64_t deadline_after(double seconds) {
    const double ns = seconds * 1e9;
    return ns > 9e18 ? INT64_MAX : now_ns() + static_cast<int64_t>(ns);
}

// This rank's part of the next chunk is in its slot: publish it (after every rank is done
// with the buffer's last chunk), then wait for `wait_rank`'s (-1: every rank's).
int exchange(Group* g, const void* part, int64_t bytes, int wait_rank, int64_t deadline, int* who) {
    const uint64_t seq = ++g->seq;
    if (part != nullptr) {
        if (int s = wait_all(g, seq - 1, deadline, who)) return s;
        std::memcpy(slot(g, seq, g->rank), part, bytes);
    }
    flag(g, g->rank).store(seq, std::memory_order_release);
    if (wait_rank < 0) return wait_all(g, seq, deadline, who);
    if (wait_rank == g->rank) return kOk;
    return wait_for(g, wait_rank, seq, deadline, who);
}

void add_slots(Group* g, uint64_t seq, float* out, int64_t n) {
    const float* a = reinterpret_cast<const float*>(slot(g, seq, 0));
    const float* b = reinterpret_cast<const float*>(slot(g, seq, 1));
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    for (int r = 2; r < g->world; ++r) {  // a fixed order: every rank gets the same bits
        const float* c = reinterpret_cast<const float*>(slot(g, seq, r));
        for (int64_t i = 0; i < n; ++i) out[i] += c[i];
    }
}

// Copy `bytes` of rank r's chunk (input bytes from `offset`) to where they go in an
// all-gather's output: rows of `row_bytes` per rank, the ranks side by side in each row.
void place(Group* g, const char* from, int r, int64_t offset, int64_t bytes, char* out,
           int64_t row_bytes) {
    while (bytes > 0) {
        const int64_t row = offset / row_bytes, col = offset % row_bytes;
        const int64_t n = bytes < row_bytes - col ? bytes : row_bytes - col;
        std::memcpy(out + (row * g->world + r) * row_bytes + col, from, n);
        from += n, offset += n, bytes -= n;
    }
}

}  // namespace

extern "C" {

int64_t pypto_shm_bytes(int world, int64_t slot_bytes) {
    return kHeaderBytes + flags_bytes(world) + 2 * world * slot_bytes;
}

// Map the segment open at `fd` as `rank` of `world`; null if it cannot be mapped.
void* pypto_shm_attach(int fd, int rank, int world, int64_t slot_bytes) {
    const int64_t size = pypto_shm_bytes(world, slot_bytes);
    void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) return nullptr;
    return new Group{static_cast<char*>(base), size, fd, rank, world, slot_bytes, 0, false};
}

void pypto_shm_detach(void* handle) {
    Group* g = static_cast<Group*>(handle);
    munmap(g->base, g->size);
    delete g;
}

// The float32 sum of every rank's `in` (n values) into `out`, rank 0's + rank 1's + ...
int pypto_shm_all_reduce(void* handle, const float* in, float* out, int64_t n, double timeout_s,
                         int* who) {
    Group* g = static_cast<Group*>(handle);
    if (g->broken) return kBroken;
    const int64_t deadline = deadline_after(timeout_s), step = g->slot_bytes / 4;
    for (int64_t at = 0; at < n; at += step) {
        const int64_t k = n - at < step ? n - at : step;
        if (int s = exchange(g, in + at, k * 4, -1, deadline, who)) return s;
        add_slots(g, g->seq, out + at, k);
    }
    return kOk;
}

// Every rank's `in` (rows x row_bytes) into `out` (rows x world x row_bytes).
int pypto_shm_all_gather(void* handle, const void* in, void* out, int64_t rows, int64_t row_bytes,
                         double timeout_s, int* who) {
    Group* g = static_cast<Group*>(handle);
    if (g->broken) return kBroken;
    const int64_t deadline = deadline_after(timeout_s), total = rows * row_bytes;
    const char* src = static_cast<const char*>(in);
    for (int64_t at = 0; at < total; at += g->slot_bytes) {
        const int64_t k = total - at < g->slot_bytes ? total - at : g->slot_bytes;
        if (int s = exchange(g, src + at, k, -1, deadline, who)) return s;
        for (int r = 0; r < g->world; ++r)
            place(g, slot(g, g->seq, r), r, at, k, static_cast<char*>(out), row_bytes);
    }
    return kOk;
}

// `root`'s `bytes` at `buf` into every other rank's `buf`.
int pypto_shm_broadcast(void* handle, void* buf, int64_t bytes, int root, double timeout_s,
                        int* who) {
    Group* g = static_cast<Group*>(handle);
    if (g->broken) return kBroken;
    const int64_t deadline = deadline_after(timeout_s);
    char* data = static_cast<char*>(buf);
    for (int64_t at = 0; at < bytes; at += g->slot_bytes) {
        const int64_t k = bytes - at < g->slot_bytes ? bytes - at : g->slot_bytes;
        const void* part = g->rank == root ? data + at : nullptr;
        if (int s = exchange(g, part, k, root, deadline, who)) return s;
        if (g->rank != root) std::memcpy(data + at, slot(g, g->seq, root), k);
    }
    return kOk;
}

}  // extern "C"
