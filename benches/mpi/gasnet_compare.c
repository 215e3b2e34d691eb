/*
 * gasnet_compare: the MPI side of the GASNet benchmark's basic figures
 * (paper: GASNet on TCA/PEACH2, section 5.1, figures 7 and 8), measured with
 * a real MPI (Open MPI or MPICH, whichever mpicc built this) so that the
 * `messaging` crate's active messages have their peer measured in the same
 * run.
 *
 * Usage: gasnet_compare MODE [key=value ...]   (2 ranks)
 *   pingpong   Blocking MPI_Send/MPI_Recv ping-pong of `bytes` bytes (the
 *              peer of the long-AM ping-pong: the paper's MPI/IB line).
 *              One way = median round trip / 2; bandwidth = bytes over that
 *              one-way time (10^9 bytes per second).
 *   get        MPI_Get of `bytes` bytes from rank 1's window by rank 0 with
 *              passive target synchronization: MPI_Win_lock(SHARED) once,
 *              then per iteration MPI_Get + MPI_Win_flush, timed together
 *              (the paper's get() latency); rank 1 makes no call meanwhile
 *              but MPI_Test of an MPI_Ibarrier (polling, as our target
 *              does). Latency = median of get + flush. The window is at
 *              least 4 KiB (MPICH 4.0 read wrong bytes from an 8-byte
 *              one).
 * Keys:
 *   sizes=8,16,...     bytes per message (default every power of two from
 *                      8 B to 4 MiB).
 *   iterations=K       timed iterations per size (default 1000); above
 *                      64 KiB a size gets K * 64 KiB / bytes of them, never
 *                      fewer than min(K, 20).
 *   warmup=W           untimed iterations before them (default 100, scaled
 *                      the same way).
 *   corrupt=1          rank 1 sends (pingpong) or exposes (get) one wrong
 *                      byte, so that a test can see the check fail.
 *
 * Every size is checked on its first and last transfer: each byte that
 * arrived is the pattern its sender stamped. Output (rank 0, stdout): one
 * JSON object per size and line, with "mpi", "test", "ranks", "bytes",
 * "iterations", "warmup", the times in microseconds (median and 99th
 * percentile), "bandwidth_gbs", "mismatches" and "verified". When a check
 * failed every rank exits with status 3.
 */
#define _GNU_SOURCE
#define PROGRAM "gasnet_compare"
#define USAGE                                                                              \
    "gasnet_compare pingpong|get [sizes=B1,B2,...] [iterations=K] [warmup=W] [corrupt=1]   " \
    "(2 ranks)"
#include "common.h"

/* One figure: `t` the summary of round trips (divisor 2: one way is half)
 * or of one-way times (divisor 1). */
static void print_figure(const char *test, long bytes, long iterations, long warmup,
                         struct summary t, double divisor, long bad) {
    double one = t.median / divisor;
    begin_figure(test);
    printf("\"ranks\": %d, \"bytes\": %ld, \"iterations\": %ld, \"warmup\": %ld, "
           "\"latency_us\": %.4f, \"latency_us_p99\": %.4f, \"bandwidth_gbs\": %.6f, ",
           ranks, bytes, iterations, warmup, one * 1e6, t.p99 / divisor * 1e6,
           (double)bytes / one / 1e9);
    print_check(bad);
    end_figure();
}

/* ---------------------------------------------------------------- pingpong */

static void print_pingpong(long bytes, long iterations, long warmup, double *times, long bad) {
    print_figure("pingpong", bytes, iterations, warmup, summarize(times, iterations), 2, bad);
}

/* --------------------------------------------------------------------- get */

/* A barrier that polls (MPI_Test of an MPI_Ibarrier) instead of letting
 * the MPI block. */
static void polling_barrier(void) {
    MPI_Request request;
    int done = 0;
    MPI_Ibarrier(MPI_COMM_WORLD, &request);
    while (!done)
        MPI_Test(&request, &done, MPI_STATUS_IGNORE);
}

static void run_get(const struct sweep *o) {
    long max_bytes = max_size(o);
    unsigned char *exposed = NULL;
    MPI_Win win;
    /* MPI_Win_allocate lets the MPI place the window where its one-sided
     * path is fastest (shared memory between ranks of one host). At least
     * a page: MPICH 4 reads wrong bytes from a window of 8 bytes (seen
     * here: 7 of 8 bytes wrong, every run; 16 bytes and more are right). */
    long window_bytes = max_bytes < 4096 ? 4096 : max_bytes;
    MPI_Win_allocate((MPI_Aint)window_bytes, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &exposed, &win);
    unsigned char *local = alloc_or_abort((size_t)max_bytes);
    double *times = alloc_or_abort(sizeof(double) * (size_t)o->iterations);
    for (int s = 0; s < o->n_sizes; s++) {
        int bytes = (int)o->sizes[s];
        long iterations = scaled(o->iterations, bytes);
        long warmup = scaled(o->warmup, bytes);
        unsigned seed = 3u * (unsigned)s + 7u;
        /* Rank 1 stamps its window; the exclusive lock makes the stores
         * visible to later passive-target accesses. */
        if (rank == 1) {
            MPI_Win_lock(MPI_LOCK_EXCLUSIVE, 1, 0, win);
            fill_pattern(exposed, (size_t)bytes, seed);
            if (o->corrupt)
                exposed[bytes / 2] ^= 0x5a;
            MPI_Win_unlock(1, win);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        long bad = 0;
        if (rank == 0) {
            MPI_Win_lock(MPI_LOCK_SHARED, 1, 0, win);
            memset(local, 0, (size_t)bytes);
            MPI_Get(local, bytes, MPI_BYTE, 1, 0, bytes, MPI_BYTE, win);
            MPI_Win_flush(1, win);
            bad += count_mismatches(local, (size_t)bytes, seed);
            for (long i = 0; i < warmup; i++) {
                MPI_Get(local, bytes, MPI_BYTE, 1, 0, bytes, MPI_BYTE, win);
                MPI_Win_flush(1, win);
            }
            for (long i = 0; i < iterations; i++) {
                double start = MPI_Wtime();
                MPI_Get(local, bytes, MPI_BYTE, 1, 0, bytes, MPI_BYTE, win);
                MPI_Win_flush(1, win);
                times[i] = MPI_Wtime() - start;
            }
            memset(local, 0, (size_t)bytes);
            MPI_Get(local, bytes, MPI_BYTE, 1, 0, bytes, MPI_BYTE, win);
            MPI_Win_flush(1, win);
            bad += count_mismatches(local, (size_t)bytes, seed);
            MPI_Win_unlock(1, win);
        }
        /* Rank 1 waits here, polling, so that an MPI whose one-sided
         * operations need the target's progress (MPICH when its window is
         * not in shared memory) gets it at once. */
        polling_barrier();
        bad = tally_mismatches(bad);
        if (rank == 0)
            print_figure("get", bytes, iterations, warmup, summarize(times, iterations), 1, bad);
    }
    free(times);
    free(local);
    MPI_Win_free(&win);
}

/* -------------------------------------------------------------------- main */

int main(int argc, char **argv) {
    start_mpi(&argc, &argv);
    if (argc < 2)
        usage_exit("no mode");
    const char *mode = argv[1];

    struct sweep o;
    default_sweep(&o, 8, 4L << 20);
    for (int i = 2; i < argc; i++)
        if (!parse_sweep_argument(argv[i], &o))
            unknown_argument(argv[i]);
    check_sweep(&o);
    check_message_sizes(&o);
    if (ranks != 2)
        usage_exit("gasnet_compare runs on exactly 2 ranks");

    if (!strcmp(mode, "pingpong"))
        run_pingpong_sweep(&o, print_pingpong);
    else if (!strcmp(mode, "get"))
        run_get(&o);
    else
        usage_exit("unknown mode");
    return finish(mode);
}
