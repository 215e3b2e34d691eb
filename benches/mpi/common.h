/*
 * common.h: what the MPI peer programs of benches/mpi share: the MPI's name,
 * the ranks, argument parsing (key=value, lists, names), error exits,
 * timing statistics, the byte pattern and its check, the byte ping-pong,
 * and the pieces of their JSON figures. `benches/src/mpi.rs` writes it next
 * to each program's source before compiling it.
 *
 * A program defines PROGRAM (its name) and USAGE (its usage line) before
 * including this header. Everything here is `static inline`, so that a
 * program that does not use a function gets no warning for it.
 */
#ifndef PINDOWN_MPI_COMMON_H
#define PINDOWN_MPI_COMMON_H

#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if !defined(PROGRAM) || !defined(USAGE)
#error "define PROGRAM and USAGE before including common.h"
#endif

#if defined(OPEN_MPI)
#define FLAVOR "openmpi"
#elif defined(MPICH_VERSION) || defined(MPICH)
#define FLAVOR "mpich"
#else
#define FLAVOR "unknown"
#endif

/* The longest list an argument may hold. */
#define MAX_LIST 64
/* Sizes above this get fewer iterations (see `scaled`)... */
#define SCALE_ABOVE (64L << 10)
/* ...but never fewer than this (or the asked number, if smaller). */
#define MIN_ITERATIONS 20
/* The largest message a program sends. */
#define MAX_MESSAGE_BYTES (1L << 30)
/* Timed and untimed iterations when the arguments do not say. */
#define DEFAULT_ITERATIONS 1000
#define DEFAULT_WARMUP 100

static int rank, ranks;

/* Sum of this program's mismatches over every figure (nonzero: exit 3). */
static long total_mismatches;

/* MPI_Init, then `rank` and `ranks`. */
static inline void start_mpi(int *argc, char ***argv) {
    MPI_Init(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
}

/* Says why (rank 0) and the usage, and stops every rank with status 2. */
static inline void usage_exit(const char *why) {
    if (rank == 0)
        fprintf(stderr, "%s: %s\nusage: %s\n", PROGRAM, why, USAGE);
    MPI_Abort(MPI_COMM_WORLD, 2);
}

static inline void unknown_argument(const char *arg) {
    char why[256];
    snprintf(why, sizeof why, "unknown argument %s", arg);
    usage_exit(why);
}

static inline void *alloc_or_abort(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "%s: rank %d: cannot allocate %zu bytes\n", PROGRAM, rank, bytes);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return p;
}

/* The value of `arg` when it is `key=value`, else NULL. */
static inline const char *value_of(const char *arg, const char *key) {
    size_t n = strlen(key);
    return !strncmp(arg, key, n) && arg[n] == '=' ? arg + n + 1 : NULL;
}

/* Parses "a,b,c" (positive integers) into `out`; returns the count. */
static inline int parse_list(const char *text, long *out) {
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

/* Parses "a,b" of `names` into flags (1 for each name listed). */
static inline void parse_names(const char *text, const char *const *names, int count,
                               int *flags) {
    memset(flags, 0, sizeof(int) * (size_t)count);
    char buf[256];
    snprintf(buf, sizeof buf, "%s", text);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        int found = 0;
        for (int i = 0; i < count; i++)
            if (!strcmp(tok, names[i]))
                flags[i] = found = 1;
        if (!found) {
            char why[300];
            snprintf(why, sizeof why, "unknown name %s", tok);
            usage_exit(why);
        }
    }
}

/* What every sweep over sizes takes: the sizes, timed and untimed
 * iterations per size, and whether to send one wrong element. */
struct sweep {
    long sizes[MAX_LIST];
    int n_sizes;
    long iterations, warmup;
    int corrupt;
};

/* Sizes every power of two from `first` to `last`, the default
 * iterations and warmup, no corruption. */
static inline void default_sweep(struct sweep *o, long first, long last) {
    memset(o, 0, sizeof *o);
    for (long b = first; b <= last; b *= 2)
        o->sizes[o->n_sizes++] = b;
    o->iterations = DEFAULT_ITERATIONS;
    o->warmup = DEFAULT_WARMUP;
}

/* Takes `arg` when it is sizes=, iterations=, warmup= or corrupt=;
 * returns whether it was. */
static inline int parse_sweep_argument(const char *arg, struct sweep *o) {
    const char *v;
    if ((v = value_of(arg, "sizes")))
        o->n_sizes = parse_list(v, o->sizes);
    else if ((v = value_of(arg, "iterations")))
        o->iterations = strtol(v, NULL, 10);
    else if ((v = value_of(arg, "warmup")))
        o->warmup = strtol(v, NULL, 10);
    else if ((v = value_of(arg, "corrupt")))
        o->corrupt = atoi(v);
    else
        return 0;
    return 1;
}

static inline void check_iterations(long iterations, long warmup) {
    if (iterations <= 0 || warmup < 0)
        usage_exit("iterations is positive, warmup is not negative");
}

static inline void check_sweep(const struct sweep *o) {
    check_iterations(o->iterations, o->warmup);
    if (o->n_sizes == 0)
        usage_exit("sizes lists at least one size");
}

/* Every size is a message of at most MAX_MESSAGE_BYTES. */
static inline void check_message_sizes(const struct sweep *o) {
    for (int s = 0; s < o->n_sizes; s++)
        if (o->sizes[s] > MAX_MESSAGE_BYTES)
            usage_exit("sizes are at most 1 GiB");
}

static inline long max_size(const struct sweep *o) {
    long max_bytes = 0;
    for (int s = 0; s < o->n_sizes; s++)
        if (o->sizes[s] > max_bytes)
            max_bytes = o->sizes[s];
    return max_bytes;
}

/* Iterations for a size: the asked number, fewer for large sizes. */
static inline long scaled(long asked, long bytes) {
    if (asked <= 0)
        return 0;
    if (bytes <= SCALE_ABOVE)
        return asked;
    long n = (long)((double)asked * (double)SCALE_ABOVE / (double)bytes);
    long floor = asked < MIN_ITERATIONS ? asked : MIN_ITERATIONS;
    return n < floor ? floor : n;
}

/* ------------------------------------------------------------- statistics */

static inline int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

struct summary {
    double median, p99, min, mean;
};

/* Sorts `t` (n > 0 values) and returns its median, its 99th percentile
 * (the smallest value at least 99 % of the values do not exceed), its
 * smallest value and its mean. */
static inline struct summary summarize(double *t, long n) {
    double total = 0;
    for (long i = 0; i < n; i++)
        total += t[i];
    qsort(t, (size_t)n, sizeof(double), compare_doubles);
    struct summary s;
    s.median = n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
    long i = (long)ceil(0.99 * (double)n) - 1;
    s.p99 = t[i < 0 ? 0 : i];
    s.min = t[0];
    s.mean = total / (double)n;
    return s;
}

/* `mine` summed over the ranks (every rank gets the sum). */
static inline long sum_over_ranks(long mine) {
    long all = 0;
    MPI_Allreduce(&mine, &all, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    return all;
}

/* Mismatches of all ranks, added to the program's total. */
static inline long tally_mismatches(long mine) {
    long all = sum_over_ranks(mine);
    total_mismatches += all;
    return all;
}

/* Replaces each rank's times[i] by the largest over the ranks (on rank 0). */
static inline void max_over_ranks(double *times, long n) {
    if (rank == 0)
        MPI_Reduce(MPI_IN_PLACE, times, (int)n, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    else
        MPI_Reduce(times, NULL, (int)n, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
}

/* ------------------------------------------------------------ the pattern */

/* The byte at `i` of a message stamped with `seed`. */
static inline unsigned char pattern(size_t i, unsigned seed) {
    return (unsigned char)((i * 131u + seed * 17u + (i >> 8)) & 0xff);
}

static inline void fill_pattern(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        p[i] = pattern(i, seed);
}

static inline long count_mismatches(const unsigned char *p, size_t n, unsigned seed) {
    long bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += p[i] != pattern(i, seed);
    return bad;
}

/* ------------------------------------------------------------- ping-pong */

/* One round trip of `count` elements of `type` between ranks 0 and 1:
 * rank 0 sends then receives, rank 1 the reverse. */
static inline void round_trip(const void *send, void *recv, int count, MPI_Datatype type) {
    if (rank == 0) {
        MPI_Send(send, count, type, 1, 0, MPI_COMM_WORLD);
        MPI_Recv(recv, count, type, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
        MPI_Recv(recv, count, type, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(send, count, type, 0, 0, MPI_COMM_WORLD);
    }
}

/* `warmup` untimed round trips, a barrier, then `iterations` timed ones,
 * each one's time in `times`. */
static inline void time_round_trips(const void *send, void *recv, int count, MPI_Datatype type,
                                    long warmup, long iterations, double *times) {
    for (long i = 0; i < warmup; i++)
        round_trip(send, recv, count, type);
    MPI_Barrier(MPI_COMM_WORLD);
    for (long i = 0; i < iterations; i++) {
        double start = MPI_Wtime();
        round_trip(send, recv, count, type);
        times[i] = MPI_Wtime() - start;
    }
}

/* One untimed exchange whose payloads are stamped with `seed` (+ rank) and
 * checked by their receivers; returns the mismatches of both ranks. Rank 1
 * sends one wrong byte when `corrupt`. */
static inline long checked_round_trip(unsigned char *send, unsigned char *recv, int bytes,
                                      unsigned seed, int corrupt) {
    fill_pattern(send, (size_t)bytes, seed + (unsigned)rank);
    if (corrupt && rank == 1)
        send[bytes / 2] ^= 0x5a;
    memset(recv, 0, (size_t)bytes);
    round_trip(send, recv, bytes, MPI_BYTE);
    return sum_over_ranks(count_mismatches(recv, (size_t)bytes, seed + (unsigned)(1 - rank)));
}

/* Called on rank 0 with one size's round trips (times[0..iterations)) and
 * the mismatches of both ranks. */
typedef void (*pingpong_figure)(long bytes, long iterations, long warmup, double *times,
                                long bad);

/* Blocking ping-pong of every size of `o` between 2 ranks: a checked
 * exchange, `warmup` untimed ones, a barrier, `iterations` timed round
 * trips and a checked exchange again (the bytes still arrive right after
 * the timed loop); hands each size's round trips to `figure`. */
static inline void run_pingpong_sweep(const struct sweep *o, pingpong_figure figure) {
    long max_bytes = max_size(o);
    unsigned char *send = alloc_or_abort((size_t)max_bytes);
    unsigned char *recv = alloc_or_abort((size_t)max_bytes);
    double *times = alloc_or_abort(sizeof(double) * (size_t)o->iterations);
    for (int s = 0; s < o->n_sizes; s++) {
        int bytes = (int)o->sizes[s];
        long iterations = scaled(o->iterations, bytes);
        long warmup = scaled(o->warmup, bytes);
        long bad = checked_round_trip(send, recv, bytes, 2u * (unsigned)s, o->corrupt);
        time_round_trips(send, recv, bytes, MPI_BYTE, warmup, iterations, times);
        bad += checked_round_trip(send, recv, bytes, 2u * (unsigned)s + 101u, o->corrupt);
        total_mismatches += bad;
        if (rank == 0)
            figure(bytes, iterations, warmup, times, bad);
    }
    free(times);
    free(recv);
    free(send);
}

/* --------------------------------------------------------------- figures */

/* Starts a figure: {"mpi": ..., "test": ..., (the caller goes on). */
static inline void begin_figure(const char *test) {
    printf("{\"mpi\": \"%s\", \"test\": \"%s\", ", FLAVOR, test);
}

/* A figure's check: "mismatches" and "verified". */
static inline void print_check(long bad) {
    printf("\"mismatches\": %ld, \"verified\": %s", bad, bad ? "false" : "true");
}

/* Ends a figure's line and flushes it. */
static inline void end_figure(void) {
    printf("}\n");
    fflush(stdout);
}

/* Says on rank 0 how many mismatches the program found (after `mode`, if
 * any), finalizes MPI and returns the exit status: 3 after a mismatch. */
static inline int finish(const char *mode) {
    if (total_mismatches && rank == 0) {
        if (mode)
            fprintf(stderr, "%s: %s: %ld mismatches in the data that arrived\n", PROGRAM, mode,
                    total_mismatches);
        else
            fprintf(stderr, "%s: %ld mismatches in the data that arrived\n", PROGRAM,
                    total_mismatches);
    }
    MPI_Finalize();
    return total_mismatches ? 3 : 0;
}

#endif
