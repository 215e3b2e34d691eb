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
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(OPEN_MPI)
#define FLAVOR "openmpi"
#elif defined(MPICH_VERSION) || defined(MPICH)
#define FLAVOR "mpich"
#else
#define FLAVOR "unknown"
#endif

#define MAX_LIST 64
#define SCALE_ABOVE (64L << 10)
#define MIN_ITERATIONS 20

static int rank, ranks;

static void usage_exit(const char *why) {
    if (rank == 0)
        fprintf(stderr,
                "gasnet_compare: %s\n"
                "usage: gasnet_compare pingpong|get [sizes=B1,B2,...] [iterations=K] "
                "[warmup=W] [corrupt=1]   (2 ranks)\n",
                why);
    MPI_Abort(MPI_COMM_WORLD, 2);
}

static void *alloc_or_abort(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "gasnet_compare: rank %d: cannot allocate %zu bytes\n", rank, bytes);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return p;
}

static int parse_list(const char *text, long *out) {
    int n = 0;
    char *p = (char *)text;
    while (*p) {
        if (n == MAX_LIST)
            usage_exit("list too long");
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v <= 0)
            usage_exit("a list holds positive integers separated by commas");
        out[n++] = v;
        p = end;
        if (*p == ',')
            p++;
        else if (*p)
            usage_exit("a list holds positive integers separated by commas");
    }
    return n;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

struct summary {
    double median, p99;
};

static struct summary summarize(double *t, long n) {
    qsort(t, (size_t)n, sizeof(double), compare_doubles);
    struct summary s;
    s.median = n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
    long i = (long)ceil(0.99 * (double)n) - 1;
    s.p99 = t[i < 0 ? 0 : i];
    return s;
}

static long scaled(long asked, long bytes) {
    if (asked <= 0)
        return 0;
    if (bytes <= SCALE_ABOVE)
        return asked;
    long n = (long)((double)asked * (double)SCALE_ABOVE / (double)bytes);
    long floor = asked < MIN_ITERATIONS ? asked : MIN_ITERATIONS;
    return n < floor ? floor : n;
}

static unsigned char pattern(size_t i, unsigned seed) {
    return (unsigned char)((i * 131u + seed * 17u + (i >> 8)) & 0xff);
}

static void fill_pattern(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        p[i] = pattern(i, seed);
}

static long count_mismatches(const unsigned char *p, size_t n, unsigned seed) {
    long bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += p[i] != pattern(i, seed);
    return bad;
}

static long sum_over_ranks(long mine) {
    long all = 0;
    MPI_Allreduce(&mine, &all, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    return all;
}

struct options {
    long sizes[MAX_LIST];
    int n_sizes;
    long iterations, warmup;
    int corrupt;
};

static long total_mismatches;

static long max_size(const struct options *o) {
    long max_bytes = 0;
    for (int s = 0; s < o->n_sizes; s++)
        if (o->sizes[s] > max_bytes)
            max_bytes = o->sizes[s];
    return max_bytes;
}

static void print_figure(const char *test, long bytes, long iterations, long warmup,
                         struct summary t, double divisor, long bad) {
    /* divisor: 2 for a ping-pong (one way is half the round trip). */
    double one = t.median / divisor;
    printf("{\"mpi\": \"%s\", \"test\": \"%s\", \"ranks\": %d, \"bytes\": %ld, "
           "\"iterations\": %ld, \"warmup\": %ld, \"latency_us\": %.4f, "
           "\"latency_us_p99\": %.4f, \"bandwidth_gbs\": %.6f, \"mismatches\": %ld, "
           "\"verified\": %s}\n",
           FLAVOR, test, ranks, bytes, iterations, warmup, one * 1e6, t.p99 / divisor * 1e6,
           (double)bytes / one / 1e9, bad, bad ? "false" : "true");
    fflush(stdout);
}

/* ---------------------------------------------------------------- pingpong */

static void exchange(const unsigned char *send, unsigned char *recv, int bytes) {
    if (rank == 0) {
        MPI_Send(send, bytes, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
        MPI_Recv(recv, bytes, MPI_BYTE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
        MPI_Recv(recv, bytes, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(send, bytes, MPI_BYTE, 0, 0, MPI_COMM_WORLD);
    }
}

static long checked_exchange(unsigned char *send, unsigned char *recv, int bytes, unsigned seed,
                             int corrupt) {
    fill_pattern(send, (size_t)bytes, seed + (unsigned)rank);
    if (corrupt && rank == 1)
        send[bytes / 2] ^= 0x5a;
    memset(recv, 0, (size_t)bytes);
    exchange(send, recv, bytes);
    return sum_over_ranks(count_mismatches(recv, (size_t)bytes, seed + (unsigned)(1 - rank)));
}

static void run_pingpong(const struct options *o) {
    long max_bytes = max_size(o);
    unsigned char *send = alloc_or_abort((size_t)max_bytes);
    unsigned char *recv = alloc_or_abort((size_t)max_bytes);
    double *times = alloc_or_abort(sizeof(double) * (size_t)o->iterations);
    for (int s = 0; s < o->n_sizes; s++) {
        int bytes = (int)o->sizes[s];
        long iterations = scaled(o->iterations, bytes);
        long warmup = scaled(o->warmup, bytes);
        long bad = checked_exchange(send, recv, bytes, 2u * (unsigned)s, o->corrupt);
        for (long i = 0; i < warmup; i++)
            exchange(send, recv, bytes);
        MPI_Barrier(MPI_COMM_WORLD);
        for (long i = 0; i < iterations; i++) {
            double start = MPI_Wtime();
            exchange(send, recv, bytes);
            times[i] = MPI_Wtime() - start;
        }
        bad += checked_exchange(send, recv, bytes, 2u * (unsigned)s + 101u, o->corrupt);
        total_mismatches += bad;
        if (rank == 0)
            print_figure("pingpong", bytes, iterations, warmup, summarize(times, iterations), 2,
                         bad);
    }
    free(times);
    free(recv);
    free(send);
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

static void run_get(const struct options *o) {
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
        bad = sum_over_ranks(bad);
        total_mismatches += bad;
        if (rank == 0)
            print_figure("get", bytes, iterations, warmup, summarize(times, iterations), 1, bad);
    }
    free(times);
    free(local);
    MPI_Win_free(&win);
}

/* -------------------------------------------------------------------- main */

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    if (argc < 2)
        usage_exit("no mode");
    const char *mode = argv[1];

    struct options o;
    memset(&o, 0, sizeof o);
    for (long b = 8; b <= (4L << 20); b *= 2)
        o.sizes[o.n_sizes++] = b;
    o.iterations = 1000;
    o.warmup = 100;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (!strncmp(a, "sizes=", 6))
            o.n_sizes = parse_list(a + 6, o.sizes);
        else if (!strncmp(a, "iterations=", 11))
            o.iterations = strtol(a + 11, NULL, 10);
        else if (!strncmp(a, "warmup=", 7))
            o.warmup = strtol(a + 7, NULL, 10);
        else if (!strncmp(a, "corrupt=", 8))
            o.corrupt = atoi(a + 8);
        else {
            char why[256];
            snprintf(why, sizeof why, "unknown argument %s", a);
            usage_exit(why);
        }
    }
    if (o.iterations <= 0 || o.warmup < 0 || o.n_sizes == 0)
        usage_exit("iterations is positive, warmup is not negative");
    for (int s = 0; s < o.n_sizes; s++)
        if (o.sizes[s] > (1L << 30))
            usage_exit("sizes are at most 1 GiB");
    if (ranks != 2)
        usage_exit("gasnet_compare runs on exactly 2 ranks");

    if (!strcmp(mode, "pingpong"))
        run_pingpong(&o);
    else if (!strcmp(mode, "get"))
        run_get(&o);
    else
        usage_exit("unknown mode");

    if (total_mismatches && rank == 0)
        fprintf(stderr, "gasnet_compare: %s: %ld mismatches in the data that arrived\n", mode,
                total_mismatches);
    MPI_Finalize();
    return total_mismatches ? 3 : 0;
}
