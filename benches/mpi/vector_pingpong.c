/*
 * vector_pingpong: DIMMnet-2's submatrix transfer (paper section 5) through
 * a real MPI, between two ranks, as the `vector-transfer` benchmark's MPI
 * baseline.
 *
 * Each rank holds a send matrix and a receive matrix of ROWS x (z + 1)
 * doubles (the paper pads each row by one). Rank 0 sends the m x n
 * submatrix at the top left of its send matrix, described by
 * MPI_Type_vector(m, n, z + 1, MPI_DOUBLE), into the same place of rank
 * 1's receive matrix; rank 1 answers in the same way (a ping-pong). The
 * "contig" kind moves the same m * n doubles between contiguous buffers
 * (MPI_DOUBLE, count m * n).
 *
 * Every exchange of the first round trip is checked on the receiving
 * side: every element of the submatrix holds the sender's value, and the
 * element after each row of it, and the row after it, still hold the
 * sentinel (nothing was written outside). Mismatches of both ranks are
 * summed and reported.
 *
 * Usage: vector_pingpong z=Z n=N m=M1,M2,... iterations=K warmup=W huge=0|1
 *        [corrupt=1]
 * corrupt=1 makes rank 1 send one wrong element (the first of the
 * submatrix), so that a test can see the check report it.
 * Output (rank 0, stdout): one JSON object per line, first a header
 * {"library": ..., "huge_pages": ...}, then one per (m, kind).
 */
#define _GNU_SOURCE
#include <sys/mman.h>

#define ROWS 4096
#define SENTINEL (-1.0)
#define HUGE_PAGE (2UL << 20)

#define STRINGIFY(x) #x
#define EXPANDED_STRING(x) STRINGIFY(x)
#define PROGRAM "vector_pingpong"
#define USAGE                                                                                  \
    "vector_pingpong z=Z n=N(<=Z) m=M1,M2,...(1.." EXPANDED_STRING(ROWS) ") iterations=K "     \
    "warmup=W huge=0|1 [corrupt=1]"
#include "common.h"

/* The value element (row, col) of a sender's matrix holds: unique, exact
 * in a double. */
static double value_at(size_t row, size_t col) {
    return (double)(row * 65536 + col) + 0.25;
}

struct matrix {
    double *data;
    size_t bytes;
    int huge;
};

/* Maps `bytes` of zeroed memory, on 2 MiB huge pages when `want_huge` and
 * the system has them reserved; exits on failure. */
static struct matrix map_matrix(size_t bytes, int want_huge) {
    struct matrix out = {NULL, bytes, 0};
    if (want_huge) {
        size_t rounded = (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
        void *p = mmap(NULL, rounded, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_POPULATE, -1, 0);
        if (p != MAP_FAILED) {
            out.data = p;
            out.bytes = rounded;
            out.huge = 1;
            return out;
        }
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("vector_pingpong: mmap");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    out.data = p;
    return out;
}

/* Mismatches in the receive matrix after an m x n vector transfer. */
static long check_vector(const double *recv, size_t ld, size_t m, size_t n) {
    long bad = 0;
    for (size_t row = 0; row < m; row++) {
        for (size_t col = 0; col < n; col++)
            bad += recv[row * ld + col] != value_at(row, col);
        if (n < ld)
            bad += recv[row * ld + n] != SENTINEL;
    }
    if (m < ROWS)
        for (size_t col = 0; col < n; col++)
            bad += recv[m * ld + col] != SENTINEL;
    return bad;
}

/* Mismatches in the contiguous receive buffer after m * n doubles. */
static long check_contig(const double *recv, size_t count) {
    long bad = 0;
    for (size_t i = 0; i < count; i++)
        bad += recv[i] != value_at(i / 65536, i % 65536);
    bad += recv[count] != SENTINEL;
    return bad;
}

static void fill(double *p, size_t count, double v) {
    for (size_t i = 0; i < count; i++)
        p[i] = v;
}

int main(int argc, char **argv) {
    start_mpi(&argc, &argv);
    if (ranks != 2) {
        char why[64];
        snprintf(why, sizeof why, "needs exactly 2 ranks, got %d", ranks);
        usage_exit(why);
    }

    size_t z = 0, n = 0;
    long ms[MAX_LIST];
    int sizes = 0;
    long iterations = 0, warmup = 0;
    int want_huge = 0, corrupt = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if ((v = value_of(a, "z")))
            z = strtoul(v, NULL, 10);
        else if ((v = value_of(a, "n")))
            n = strtoul(v, NULL, 10);
        else if ((v = value_of(a, "m")))
            sizes = parse_list(v, ms);
        else if ((v = value_of(a, "iterations")))
            iterations = strtol(v, NULL, 10);
        else if ((v = value_of(a, "warmup")))
            warmup = strtol(v, NULL, 10);
        else if ((v = value_of(a, "huge")))
            want_huge = atoi(v);
        else if ((v = value_of(a, "corrupt")))
            corrupt = atoi(v);
        else
            unknown_argument(a);
    }
    check_iterations(iterations, warmup);
    int bad_args = z == 0 || n == 0 || n > z || sizes == 0;
    for (int i = 0; i < sizes; i++)
        bad_args |= ms[i] > ROWS;
    if (bad_args)
        usage_exit("z and n are positive, n at most z, every m from 1 to " EXPANDED_STRING(ROWS));

    size_t ld = z + 1;
    size_t matrix_bytes = (size_t)ROWS * ld * sizeof(double);
    struct matrix send = map_matrix(matrix_bytes, want_huge);
    struct matrix recv = map_matrix(matrix_bytes, want_huge);
    size_t max_count = (size_t)ROWS * n;
    struct matrix send_contig = map_matrix((max_count + 1) * sizeof(double), want_huge);
    struct matrix recv_contig = map_matrix((max_count + 1) * sizeof(double), want_huge);
    for (size_t row = 0; row < ROWS; row++)
        for (size_t col = 0; col < ld; col++)
            send.data[row * ld + col] = value_at(row, col);
    for (size_t i = 0; i < max_count; i++)
        send_contig.data[i] = value_at(i / 65536, i % 65536);
    if (corrupt && rank == 1) {
        send.data[0] += 1;
        send_contig.data[0] += 1;
    }
    int huge = send.huge && recv.huge && send_contig.huge && recv_contig.huge;
    int huge_all = 0;
    MPI_Allreduce(&huge, &huge_all, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);

    if (rank == 0) {
        char library[MPI_MAX_LIBRARY_VERSION_STRING];
        int len = 0;
        MPI_Get_library_version(library, &len);
        /* Its first line only (MPICH's goes on with its configure line). */
        for (int i = 0; i < len; i++)
            if (library[i] == '\n') {
                len = i;
                break;
            }
        for (int i = 0; i < len; i++)
            if (library[i] == '"' || library[i] == '\\' || (unsigned char)library[i] < 32)
                library[i] = ' ';
        while (len > 0 && library[len - 1] == ' ')
            len--;
        library[len] = 0;
        printf("{\"library\": \"%s\", \"huge_pages\": %s, \"z\": %zu, \"n\": %zu", library,
               huge_all ? "true" : "false", z, n);
        end_figure();
    }

    double *times = alloc_or_abort(sizeof(double) * (size_t)iterations);
    for (int s = 0; s < sizes; s++) {
        size_t m = (size_t)ms[s];
        MPI_Datatype vector;
        MPI_Type_vector((int)m, (int)n, (int)ld, MPI_DOUBLE, &vector);
        MPI_Type_commit(&vector);
        for (int contig = 0; contig < 2; contig++) {
            size_t count = m * n;
            const void *src = contig ? (void *)send_contig.data : (void *)send.data;
            void *dst = contig ? (void *)recv_contig.data : (void *)recv.data;
            int elements = contig ? (int)count : 1;
            MPI_Datatype type = contig ? MPI_DOUBLE : vector;
            if (contig)
                fill(recv_contig.data, count + 1, SENTINEL);
            else
                fill(recv.data, (m < ROWS ? m + 1 : m) * ld, SENTINEL);
            MPI_Barrier(MPI_COMM_WORLD);
            round_trip(src, dst, elements, type);
            long bad = contig ? check_contig(recv_contig.data, count)
                              : check_vector(recv.data, ld, m, n);
            long bad_all = sum_over_ranks(bad);
            time_round_trips(src, dst, elements, type, warmup, iterations, times);
            if (rank == 0) {
                struct summary t = summarize(times, iterations);
                double bytes = (double)count * sizeof(double);
                /* One way = half a round trip, in microseconds. */
                double one_way_us = t.median / 2 * 1e6;
                printf("{\"kind\": \"%s\", \"z\": %zu, \"n\": %zu, \"m\": %zu, \"bytes\": %.0f, "
                       "\"iterations\": %ld, \"one_way_us_median\": %.4f, "
                       "\"one_way_us_min\": %.4f, \"one_way_us_mean\": %.4f, "
                       "\"mb_per_s\": %.3f, ",
                       contig ? "contig" : "vector", z, n, m, bytes, iterations, one_way_us,
                       t.min / 2 * 1e6, t.mean / 2 * 1e6, bytes / one_way_us);
                print_check(bad_all);
                end_figure();
            }
        }
        MPI_Type_free(&vector);
    }
    free(times);
    /* Mismatches are reported in the figures, not by the exit status. */
    return finish(NULL);
}
