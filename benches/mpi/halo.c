/*
 * halo: the MPI side of the GASNet benchmark's halo exchange (paper: GASNet
 * on TCA/PEACH2, section 5.2, figures 9 and 10), measured with a real MPI
 * (Open MPI or MPICH, whichever mpicc built this).
 *
 * Each rank holds one N x N x N array of doubles, element (x, y, z) at
 * (x * N + y) * N + z. A face is a plane of it; the three orientations are
 * the paper's three transfer kinds:
 *   block        x = const: N * N contiguous doubles.
 *   blockstride  y = const: N blocks of N doubles, N * N apart.
 *   stride       z = const: N * N single doubles, N apart.
 * Planes 0 and N - 1 of the face's dimension are ghosts; a rank sends its
 * plane N - 2 to its right neighbour's ghost 0 and its plane 1 to its left
 * neighbour's ghost N - 1. Each face is described by a derived datatype,
 * one of
 *   vector       MPI_Type_vector (block: one block of N * N; blockstride:
 *                (N, N, N * N); stride: (N * N, 1, N)),
 *   subarray     MPI_Type_create_subarray of the N^3 array with the face's
 *                subsizes (1 along its dimension), C order,
 * and is sent and received in place (no packing by the program).
 *
 * Usage: halo [key=value ...]
 *   pattern=pingpong   2 ranks, the paper's form: rank 0 sends its face to
 *                      rank 1 (MPI_Send/MPI_Recv), rank 1 answers with its
 *                      own; one way = median round trip / 2.
 *   pattern=exchange   any ranks >= 2 in a chain (not periodic): every rank
 *                      exchanges with both neighbours (MPI_Sendrecv right,
 *                      then left); time per exchange = the slowest rank's,
 *                      median over the iterations (after a barrier each).
 *   sizes=4,8,...      N (default 4 8 16 32 64 128 256 512; 512 needs
 *                      1 GiB per rank).
 *   faces=block,blockstride,stride   (default all three)
 *   types=vector,subarray            (default both)
 *   iterations=K       timed iterations per (N, face, type) (default 1000;
 *                      above a 64 KiB face, K * 64 KiB / face bytes, never
 *                      fewer than min(K, 20)).
 *   warmup=W           untimed iterations first (default 100, scaled so).
 *   corrupt=1          the last rank sends one wrong element, so that a
 *                      test can see the check fail.
 *
 * Checks: before the first timed iteration and after the last, the ghost
 * planes are set to a sentinel, one exchange (or round trip) runs, and
 * every ghost element a neighbour sends must hold that neighbour's value;
 * the planes next to the ghosts must still hold the rank's own values
 * (nothing landed outside the face). Output (rank 0, stdout): one JSON
 * object per (N, face, type) and line with "mpi", "test": "halo",
 * "pattern", "ranks", "n", "face", "datatype", "bytes" (one face),
 * "iterations", "warmup", "time_us" (one way or one exchange, median),
 * "time_us_p99", "bandwidth_gbs" (face bytes over time_us), "mismatches",
 * "verified". When a check failed every rank exits with status 3.
 */
#define _GNU_SOURCE
#define PROGRAM "halo"
#define USAGE                                                                                \
    "halo [pattern=pingpong|exchange] [sizes=N1,N2,...] [faces=block,blockstride,stride] "     \
    "[types=vector,subarray] [iterations=K] [warmup=W] [corrupt=1]"
#include "common.h"

#define SENTINEL (-1.0)

/* ------------------------------------------------------------------ faces */

enum face { BLOCK, BLOCKSTRIDE, STRIDE, FACES };
static const char *const face_names[FACES] = {"block", "blockstride", "stride"};
enum datatype { VECTOR, SUBARRAY, DATATYPES };
static const char *const datatype_names[DATATYPES] = {"vector", "subarray"};

/* The value of element (x, y, z) on rank r: unique and exact in a double
 * for N <= 512 and any rank count an MPI job here has. */
static double value_at(int r, long n, long x, long y, long z) {
    return (double)r * 1e9 + (double)((x * n + y) * n + z) + 0.5;
}

/* The distance between consecutive planes of `face`'s dimension. */
static long plane_stride(enum face f, long n) {
    return f == BLOCK ? n * n : f == BLOCKSTRIDE ? n : 1;
}

static MPI_Datatype face_type(enum face f, enum datatype d, long n) {
    MPI_Datatype t;
    if (d == VECTOR) {
        if (f == BLOCK)
            MPI_Type_vector(1, (int)(n * n), (int)(n * n), MPI_DOUBLE, &t);
        else if (f == BLOCKSTRIDE)
            MPI_Type_vector((int)n, (int)n, (int)(n * n), MPI_DOUBLE, &t);
        else
            MPI_Type_vector((int)(n * n), 1, (int)n, MPI_DOUBLE, &t);
    } else {
        int sizes[3] = {(int)n, (int)n, (int)n};
        int subsizes[3] = {(int)n, (int)n, (int)n};
        int starts[3] = {0, 0, 0};
        subsizes[f] = 1; /* BLOCK is x, BLOCKSTRIDE y, STRIDE z */
        MPI_Type_create_subarray(3, sizes, subsizes, starts, MPI_ORDER_C, MPI_DOUBLE, &t);
    }
    MPI_Type_commit(&t);
    return t;
}

/* Runs the statements after `p` with x, y, z set to every element of plane
 * `p` of face `f`. */
#define FOR_PLANE(f, n, p, ...)                                                          \
    for (long i_ = 0; i_ < (n); i_++)                                                    \
        for (long j_ = 0; j_ < (n); j_++) {                                              \
            long x = (f) == BLOCK ? (p) : i_;                                            \
            long y = (f) == BLOCK ? i_ : (f) == BLOCKSTRIDE ? (p) : j_;                  \
            long z = (f) == STRIDE ? (p) : j_;                                           \
            __VA_ARGS__;                                                                 \
        }

static void fill(double *a, long n) {
    for (long x = 0; x < n; x++)
        for (long y = 0; y < n; y++)
            for (long z = 0; z < n; z++)
                a[(x * n + y) * n + z] = value_at(rank, n, x, y, z);
}

static void clear_ghosts(double *a, enum face f, long n) {
    FOR_PLANE(f, n, 0, a[(x * n + y) * n + z] = SENTINEL);
    FOR_PLANE(f, n, n - 1, a[(x * n + y) * n + z] = SENTINEL);
}

/* Mismatches of this rank after one exchange: ghost 0 holds the left
 * neighbour's plane N - 2 (and ghost N - 1 the right one's plane 1), a
 * ghost without a neighbour still the sentinel; planes 1 and N - 2 hold
 * this rank's own values. */
static long check(const double *a, enum face f, long n, int left, int right) {
    long bad = 0;
    long last = n - 1;
    FOR_PLANE(f, n, 0, {
        long sx = f == BLOCK ? n - 2 : x, sy = f == BLOCKSTRIDE ? n - 2 : y,
             sz = f == STRIDE ? n - 2 : z;
        double want = left == MPI_PROC_NULL ? SENTINEL : value_at(left, n, sx, sy, sz);
        bad += a[(x * n + y) * n + z] != want;
    });
    FOR_PLANE(f, n, last, {
        long sx = f == BLOCK ? 1 : x, sy = f == BLOCKSTRIDE ? 1 : y, sz = f == STRIDE ? 1 : z;
        double want = right == MPI_PROC_NULL ? SENTINEL : value_at(right, n, sx, sy, sz);
        bad += a[(x * n + y) * n + z] != want;
    });
    FOR_PLANE(f, n, 1, bad += a[(x * n + y) * n + z] != value_at(rank, n, x, y, z));
    FOR_PLANE(f, n, n - 2, bad += a[(x * n + y) * n + z] != value_at(rank, n, x, y, z));
    return bad;
}

/* --------------------------------------------------------------- patterns */

struct options {
    struct sweep sweep; /* sizes are N */
    int faces[FACES], types[DATATYPES];
    int exchange;
};

/* One ping-pong (2 ranks): rank 0's plane N - 2 to rank 1's ghost 0, rank
 * 1's plane 1 back to rank 0's ghost N - 1. */
static void pingpong_once(double *a, MPI_Datatype t, long stride, long n) {
    if (rank == 0) {
        MPI_Send(a + (n - 2) * stride, 1, t, 1, 0, MPI_COMM_WORLD);
        MPI_Recv(a + (n - 1) * stride, 1, t, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
        MPI_Recv(a, 1, t, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(a + stride, 1, t, 0, 0, MPI_COMM_WORLD);
    }
}

/* One chain exchange: right, then left. */
static void exchange_once(double *a, MPI_Datatype t, long stride, long n, int left, int right) {
    MPI_Sendrecv(a + (n - 2) * stride, 1, t, right, 1, a, 1, t, left, 1, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
    MPI_Sendrecv(a + stride, 1, t, left, 2, a + (n - 1) * stride, 1, t, right, 2,
                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
}

static void run_case(const struct options *o, double *a, long n, enum face f, enum datatype d,
                     double *times) {
    MPI_Datatype t = face_type(f, d, n);
    long stride = plane_stride(f, n);
    long bytes = n * n * (long)sizeof(double);
    long iterations = scaled(o->sweep.iterations, bytes);
    long warmup = scaled(o->sweep.warmup, bytes);
    int left = rank > 0 ? rank - 1 : MPI_PROC_NULL;
    int right = rank < ranks - 1 ? rank + 1 : MPI_PROC_NULL;
    long bad = 0;
    for (int pass = 0; pass < 2; pass++) {
        /* A checked exchange: before the timed loop, then after it. */
        fill(a, n);
        if (o->sweep.corrupt && rank == ranks - 1) {
            /* The element (1, 1, 1) of plane 1 is in every face a rank
             * with a left neighbour sends. */
            a[(n + 1) * n + 1] += 1;
        }
        clear_ghosts(a, f, n);
        MPI_Barrier(MPI_COMM_WORLD);
        if (o->exchange)
            exchange_once(a, t, stride, n, left, right);
        else
            pingpong_once(a, t, stride, n);
        if (o->sweep.corrupt && rank == ranks - 1)
            a[(n + 1) * n + 1] -= 1;
        bad += check(a, f, n, left, right);
        if (pass == 1)
            break;
        for (long i = 0; i < warmup; i++) {
            if (o->exchange)
                exchange_once(a, t, stride, n, left, right);
            else
                pingpong_once(a, t, stride, n);
        }
        for (long i = 0; i < iterations; i++) {
            if (o->exchange) {
                MPI_Barrier(MPI_COMM_WORLD);
                double start = MPI_Wtime();
                exchange_once(a, t, stride, n, left, right);
                times[i] = MPI_Wtime() - start;
            } else {
                double start = MPI_Wtime();
                pingpong_once(a, t, stride, n);
                times[i] = (MPI_Wtime() - start) / 2;
            }
        }
        if (o->exchange)
            max_over_ranks(times, iterations);
    }
    MPI_Type_free(&t);
    bad = tally_mismatches(bad);
    if (rank == 0) {
        struct summary s = summarize(times, iterations);
        begin_figure("halo");
        printf("\"pattern\": \"%s\", \"ranks\": %d, \"n\": %ld, \"face\": \"%s\", "
               "\"datatype\": \"%s\", \"bytes\": %ld, \"iterations\": %ld, \"warmup\": %ld, "
               "\"time_us\": %.4f, \"time_us_p99\": %.4f, \"bandwidth_gbs\": %.6f, ",
               o->exchange ? "exchange" : "pingpong", ranks, n, face_names[f], datatype_names[d],
               bytes, iterations, warmup, s.median * 1e6, s.p99 * 1e6,
               (double)bytes / s.median / 1e9);
        print_check(bad);
        end_figure();
    }
}

int main(int argc, char **argv) {
    start_mpi(&argc, &argv);

    struct options o;
    memset(&o, 0, sizeof o);
    default_sweep(&o.sweep, 4, 512);
    for (int i = 0; i < FACES; i++)
        o.faces[i] = 1;
    for (int i = 0; i < DATATYPES; i++)
        o.types[i] = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (parse_sweep_argument(a, &o.sweep))
            continue;
        if ((v = value_of(a, "faces")))
            parse_names(v, face_names, FACES, o.faces);
        else if ((v = value_of(a, "types")))
            parse_names(v, datatype_names, DATATYPES, o.types);
        else if (!strcmp(a, "pattern=pingpong"))
            o.exchange = 0;
        else if (!strcmp(a, "pattern=exchange"))
            o.exchange = 1;
        else
            unknown_argument(a);
    }
    check_sweep(&o.sweep);
    for (int s = 0; s < o.sweep.n_sizes; s++)
        if (o.sweep.sizes[s] < 4 || o.sweep.sizes[s] > 1024)
            usage_exit("N is from 4 to 1024");
    if (o.exchange ? ranks < 2 : ranks != 2)
        usage_exit("pattern=pingpong runs on 2 ranks, pattern=exchange on at least 2");

    double *times = alloc_or_abort(sizeof(double) * (size_t)o.sweep.iterations);
    for (int s = 0; s < o.sweep.n_sizes; s++) {
        long n = o.sweep.sizes[s];
        double *a = alloc_or_abort(sizeof(double) * (size_t)(n * n * n));
        for (int f = 0; f < FACES; f++)
            for (int d = 0; d < DATATYPES; d++)
                if (o.faces[f] && o.types[d])
                    run_case(&o, a, n, (enum face)f, (enum datatype)d, times);
        free(a);
    }
    free(times);
    return finish(NULL);
}
