/*
 * fmpl_compare: the MPI side of the FMPL benchmark (paper: FMPL, a message
 * passing library on the SR8000's remote DMA, section 6). The same figures
 * the paper gives for FMPL and the vendor's MPI, measured here with a real
 * MPI (Open MPI or MPICH, whichever mpicc built this) so that the
 * `messaging` crate has its peer measured in the same run.
 *
 * Usage: fmpl_compare MODE [key=value ...]
 *   pingpong   2 ranks. Blocking MPI_Send/MPI_Recv ping-pong of `bytes`
 *              bytes. One way = median round trip / 2; bandwidth = bytes
 *              over that one-way time (10^9 bytes per second).
 *   preposted  2 ranks. The paper's table 2 (see below).
 *   barrier    any ranks. MPI_Barrier, time per call.
 *   bcast      any ranks. MPI_Bcast from rank 0, time per call.
 *   allreduce  any ranks. MPI_Allreduce of bytes / 8 doubles, MPI_SUM, time
 *              per call.
 * Keys:
 *   sizes=8,16,...     message sizes in bytes (pingpong, bcast, allreduce;
 *                      allreduce needs multiples of 8). Default: every
 *                      power of two from 8 B to 16 MiB.
 *   iterations=K       timed iterations per size (default 1000). Above
 *                      64 KiB a size gets K * 64 KiB / bytes of them, but
 *                      never fewer than min(K, 20); each figure says how
 *                      many it used.
 *   warmup=W           untimed iterations before them (default 100, scaled
 *                      the same way, at least 1 when W > 0).
 *   posted=1,600       preposted: receives posted ahead (default 1 and 600).
 *   order=both         preposted: reverse, in_order or both (default).
 *   repeats=R          preposted: repetitions (default 10).
 *   corrupt=1          one wrong element is sent (by rank 1 in pingpong, by
 *                      rank 0 in preposted and bcast, by the last rank in
 *                      allreduce), so that a test can see the check fail.
 *
 * Timing: collective and ping-pong iterations are separated by nothing (a
 * ping-pong) or by an MPI_Barrier (collectives: every rank times its own
 * call; the time of an iteration is the largest over the ranks, gathered
 * after the timed loop so that it does not disturb it). Each figure gives
 * the median and the 99th percentile of its iterations.
 *
 * Table 2 of the paper ("gap of succeeding nonblocking receive calls and
 * 4-byte one-way latency with 600 outstanding nonblocking receives"):
 * FMPL 7.03 us / 9.90 us, Hitachi MPI 370.1 us / 945.8 us. The paper's gap
 * is the time between consecutive MPI_Irecv calls of a receiver that posts
 * 600 of them ahead (Hitachi's MPI checked every earlier pending receive at
 * each post); its latency is, like its ping-pong figures, "derived from the
 * ping-pong latency" with the receives already posted, so that the send only
 * has to deliver the message. This program measures, per (posted = N,
 * order), for `repeats` repetitions, with 8-byte messages:
 *   post_gap_us   rank 1 posts N MPI_Irecv (tags 0..N-1, distinct buffers):
 *                 their total time / N. The paper's gap.
 *   send_gap_us   after a barrier, rank 0 sends N messages with MPI_Send,
 *                 tags in reverse order of posting (the last posted matched
 *                 first, so a receiver's queue of posted receives is searched
 *                 to its end) or in order: total time of the N sends / N,
 *                 i.e. the mean time between consecutive sends returning
 *                 (the first counted from before the first send). Rank 1
 *                 waits for all and checks every payload.
 *   latency_us    rank 1 posts N receives again; rank 0 sends one 8-byte
 *                 message to one of them and waits for a matched 8-byte
 *                 ack (the payload echoed, tag N, which rank 0 checks);
 *                 rank 1 waits for that receive, checks it, posts it again
 *                 (so N receives stay pending and the next message finds the
 *                 queue as deep) and sends the ack. Reverse order: always
 *                 the last-posted receive's tag (the one at the queue's
 *                 end); in order: tag round % N (the one at its head). One
 *                 way = half the round trip; median and p99 over all timed
 *                 rounds of all repetitions. Afterwards rank 0 sends one
 *                 message to each receive still pending (checked, untimed).
 * post_gap_us and send_gap_us are the medians over the repetitions.
 *
 * Output (rank 0, stdout): one JSON object per figure and line, each with
 * "mpi" ("openmpi" or "mpich"), "test" (the mode) and "ranks". Every figure
 * that moves data checks it ("mismatches", "verified"); when any check
 * failed, rank 0 says so on stderr and every rank exits with status 3.
 */
#define _GNU_SOURCE
#define PROGRAM "fmpl_compare"
#define USAGE                                                                               \
    "fmpl_compare pingpong|preposted|barrier|bcast|allreduce [sizes=B1,B2,...] "              \
    "[iterations=K] [warmup=W] [posted=N1,N2,...] [order=reverse|in_order|both] [repeats=R] " \
    "[corrupt=1]"
#include "common.h"

struct options {
    struct sweep sweep;
    long repeats;
    long posted[MAX_LIST];
    int n_posted;
    int reverse, in_order;
};

/* ---------------------------------------------------------------- pingpong */

static void print_pingpong(long bytes, long iterations, long warmup, double *times, long bad) {
    struct summary rt = summarize(times, iterations);
    double one_way = rt.median / 2;
    begin_figure("pingpong");
    printf("\"ranks\": %d, \"bytes\": %ld, \"iterations\": %ld, \"warmup\": %ld, "
           "\"one_way_us\": %.4f, \"one_way_us_p99\": %.4f, \"round_trip_us\": %.4f, "
           "\"round_trip_us_p99\": %.4f, \"bandwidth_gbs\": %.6f, ",
           ranks, bytes, iterations, warmup, one_way * 1e6, rt.p99 / 2 * 1e6, rt.median * 1e6,
           rt.p99 * 1e6, (double)bytes / one_way / 1e9);
    print_check(bad);
    end_figure();
}

/* --------------------------------------------------------------- preposted */

#define PREPOSTED_BYTES 8

/* The payload of message `seq` of repetition `rep` (8 bytes). */
static uint64_t stamp(long rep, long seq) {
    return 0x9e3779b97f4a7c15ull ^ ((uint64_t)rep << 40) ^ (uint64_t)seq;
}

static void post_all(uint64_t *bufs, MPI_Request *reqs, long n) {
    for (long t = 0; t < n; t++)
        MPI_Irecv(&bufs[t], PREPOSTED_BYTES, MPI_BYTE, 0, (int)t, MPI_COMM_WORLD, &reqs[t]);
}

/* Waits for each of `n` requests (MPI_Waitall with MPI_STATUSES_IGNORE
 * trips GCC's -Wstringop-overflow on MPICH's header). */
static void wait_each(MPI_Request *reqs, long n) {
    for (long t = 0; t < n; t++)
        MPI_Wait(&reqs[t], MPI_STATUS_IGNORE);
}

/* The tag of the i-th send of a burst of n. */
static long burst_tag(int reverse, long n, long i) {
    return reverse ? n - 1 - i : i;
}

static void run_preposted_case(const struct options *o, long n, int reverse) {
    long rounds = o->sweep.warmup + o->sweep.iterations;
    uint64_t *bufs = alloc_or_abort(sizeof(uint64_t) * (size_t)n);
    MPI_Request *reqs = alloc_or_abort(sizeof(MPI_Request) * (size_t)n);
    double *post_gaps = alloc_or_abort(sizeof(double) * (size_t)o->repeats);
    double *send_gaps = alloc_or_abort(sizeof(double) * (size_t)o->repeats);
    double *half_trips =
        alloc_or_abort(sizeof(double) * (size_t)(o->repeats * o->sweep.iterations));
    long bad = 0;
    int ack_tag = (int)n;

    for (long rep = 0; rep < o->repeats; rep++) {
        /* (a) the gaps: rank 1 posts N, rank 0 sends N back to back. */
        memset(bufs, 0, sizeof(uint64_t) * (size_t)n);
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 1) {
            double start = MPI_Wtime();
            post_all(bufs, reqs, n);
            post_gaps[rep] = (MPI_Wtime() - start) / (double)n;
        }
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 0) {
            double start = MPI_Wtime();
            for (long i = 0; i < n; i++) {
                long tag = burst_tag(reverse, n, i);
                uint64_t payload = stamp(rep, tag);
                if (o->sweep.corrupt && i == n / 2)
                    payload ^= 1;
                MPI_Send(&payload, PREPOSTED_BYTES, MPI_BYTE, 1, (int)tag, MPI_COMM_WORLD);
            }
            send_gaps[rep] = (MPI_Wtime() - start) / (double)n;
        } else {
            wait_each(reqs, n);
            for (long t = 0; t < n; t++)
                bad += bufs[t] != stamp(rep, t);
        }

        /* (b) the latency: N receives stay posted while one of them is
         * matched by a ping whose ack rank 0 waits for. */
        memset(bufs, 0, sizeof(uint64_t) * (size_t)n);
        if (rank == 1)
            post_all(bufs, reqs, n);
        MPI_Barrier(MPI_COMM_WORLD);
        for (long r = 0; r < rounds; r++) {
            long tag = reverse ? n - 1 : r % n;
            uint64_t payload = stamp(rep, 1000000 + r), echo = 0;
            if (rank == 0) {
                if (o->sweep.corrupt && r == rounds / 2)
                    payload ^= 1;
                double start = MPI_Wtime();
                MPI_Send(&payload, PREPOSTED_BYTES, MPI_BYTE, 1, (int)tag, MPI_COMM_WORLD);
                MPI_Recv(&echo, PREPOSTED_BYTES, MPI_BYTE, 1, ack_tag, MPI_COMM_WORLD,
                         MPI_STATUS_IGNORE);
                double elapsed = MPI_Wtime() - start;
                if (r >= o->sweep.warmup)
                    half_trips[rep * o->sweep.iterations + (r - o->sweep.warmup)] = elapsed / 2;
                bad += echo != payload;
            } else {
                MPI_Wait(&reqs[tag], MPI_STATUS_IGNORE);
                echo = bufs[tag];
                bad += echo != payload;
                bufs[tag] = 0;
                MPI_Irecv(&bufs[tag], PREPOSTED_BYTES, MPI_BYTE, 0, (int)tag, MPI_COMM_WORLD,
                          &reqs[tag]);
                MPI_Send(&echo, PREPOSTED_BYTES, MPI_BYTE, 0, ack_tag, MPI_COMM_WORLD);
            }
        }
        /* Complete the receives still pending, untimed. */
        if (rank == 0) {
            for (long t = 0; t < n; t++) {
                uint64_t payload = stamp(rep, 2000000 + t);
                MPI_Send(&payload, PREPOSTED_BYTES, MPI_BYTE, 1, (int)t, MPI_COMM_WORLD);
            }
        } else {
            wait_each(reqs, n);
            for (long t = 0; t < n; t++)
                bad += bufs[t] != stamp(rep, 2000000 + t);
        }
    }

    /* Rank 1's posting gaps to rank 0. */
    if (rank == 1)
        MPI_Send(post_gaps, (int)o->repeats, MPI_DOUBLE, 0, ack_tag + 1, MPI_COMM_WORLD);
    else
        MPI_Recv(post_gaps, (int)o->repeats, MPI_DOUBLE, 1, ack_tag + 1, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
    bad = tally_mismatches(bad);
    if (rank == 0) {
        struct summary post = summarize(post_gaps, o->repeats);
        struct summary send = summarize(send_gaps, o->repeats);
        struct summary latency = summarize(half_trips, o->repeats * o->sweep.iterations);
        begin_figure("preposted");
        printf("\"ranks\": %d, \"posted\": %ld, \"order\": \"%s\", \"bytes\": %d, "
               "\"repeats\": %ld, \"iterations\": %ld, \"warmup\": %ld, \"post_gap_us\": %.4f, "
               "\"send_gap_us\": %.4f, \"latency_us\": %.4f, \"latency_us_p99\": %.4f, ",
               ranks, n, reverse ? "reverse" : "in_order", PREPOSTED_BYTES, o->repeats,
               o->sweep.iterations, o->sweep.warmup, post.median * 1e6, send.median * 1e6,
               latency.median * 1e6, latency.p99 * 1e6);
        print_check(bad);
        end_figure();
    }
    free(half_trips);
    free(send_gaps);
    free(post_gaps);
    free(reqs);
    free(bufs);
}

static void run_preposted(const struct options *o) {
    int tag_ub_flag = 0;
    int *tag_ub = NULL;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &tag_ub_flag);
    for (int p = 0; p < o->n_posted; p++) {
        if (tag_ub_flag && o->posted[p] + 1 > *tag_ub)
            usage_exit("posted exceeds MPI_TAG_UB");
        if (o->reverse)
            run_preposted_case(o, o->posted[p], 1);
        if (o->in_order)
            run_preposted_case(o, o->posted[p], 0);
    }
}

/* -------------------------------------------------------------- collectives */

static void print_collective(const char *test, long bytes, long iterations, long warmup,
                             double *times, long bad, int checked) {
    if (rank != 0)
        return;
    struct summary t = summarize(times, iterations);
    begin_figure(test);
    printf("\"ranks\": %d, ", ranks);
    if (bytes >= 0) {
        printf("\"bytes\": %ld, ", bytes);
        if (!strcmp(test, "allreduce"))
            printf("\"count\": %ld, ", bytes / (long)sizeof(double));
    }
    printf("\"iterations\": %ld, \"warmup\": %ld, \"time_us\": %.4f, \"time_us_p99\": %.4f",
           iterations, warmup, t.median * 1e6, t.p99 * 1e6);
    if (checked) {
        printf(", ");
        print_check(bad);
    }
    end_figure();
}

static void run_barrier(const struct sweep *o) {
    double *times = alloc_or_abort(sizeof(double) * (size_t)o->iterations);
    for (long i = 0; i < o->warmup; i++)
        MPI_Barrier(MPI_COMM_WORLD);
    for (long i = 0; i < o->iterations; i++) {
        double start = MPI_Wtime();
        MPI_Barrier(MPI_COMM_WORLD);
        times[i] = MPI_Wtime() - start;
    }
    max_over_ranks(times, o->iterations);
    /* A barrier carries no data: nothing to check. */
    print_collective("barrier", -1, o->iterations, o->warmup, times, 0, 0);
    free(times);
}

/* One untimed broadcast stamped with `seed`, checked by every other rank. */
static long checked_bcast(unsigned char *buf, int bytes, unsigned seed, int corrupt) {
    if (rank == 0) {
        fill_pattern(buf, (size_t)bytes, seed);
        if (corrupt)
            buf[bytes / 2] ^= 0x5a;
    } else {
        memset(buf, 0, (size_t)bytes);
    }
    MPI_Bcast(buf, bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
    return sum_over_ranks(rank == 0 ? 0 : count_mismatches(buf, (size_t)bytes, seed));
}

static void run_bcast(const struct sweep *o) {
    unsigned char *buf = alloc_or_abort((size_t)max_size(o));
    double *times = alloc_or_abort(sizeof(double) * (size_t)o->iterations);
    for (int s = 0; s < o->n_sizes; s++) {
        int bytes = (int)o->sizes[s];
        long iterations = scaled(o->iterations, bytes);
        long warmup = scaled(o->warmup, bytes);
        long bad = checked_bcast(buf, bytes, 2u * (unsigned)s, o->corrupt);
        for (long i = 0; i < warmup; i++)
            MPI_Bcast(buf, bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
        for (long i = 0; i < iterations; i++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double start = MPI_Wtime();
            MPI_Bcast(buf, bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
            times[i] = MPI_Wtime() - start;
        }
        max_over_ranks(times, iterations);
        bad += checked_bcast(buf, bytes, 2u * (unsigned)s + 101u, o->corrupt);
        total_mismatches += bad;
        print_collective("bcast", bytes, iterations, warmup, times, bad, 1);
    }
    free(times);
    free(buf);
}

/* Rank r's element i: small integers, so that any order of summing them is
 * exact. */
static double contribution(int r, long i) {
    return (double)((r + 1) * (i % 1021 + 1));
}

static void run_allreduce(const struct sweep *o) {
    for (int s = 0; s < o->n_sizes; s++)
        if (o->sizes[s] % (long)sizeof(double))
            usage_exit("allreduce sizes are multiples of 8 bytes");
    long max_count = max_size(o) / (long)sizeof(double);
    double *in = alloc_or_abort(sizeof(double) * (size_t)max_count);
    double *out = alloc_or_abort(sizeof(double) * (size_t)max_count);
    double *times = alloc_or_abort(sizeof(double) * (size_t)o->iterations);
    for (long i = 0; i < max_count; i++)
        in[i] = contribution(rank, i);
    if (o->corrupt && rank == ranks - 1)
        in[0] += 1;
    for (int s = 0; s < o->n_sizes; s++) {
        long count = o->sizes[s] / (long)sizeof(double);
        long iterations = scaled(o->iterations, o->sizes[s]);
        long warmup = scaled(o->warmup, o->sizes[s]);
        /* The reference: the same sum computed here. Checked after the
         * first call (into a cleared buffer) and after the last timed one. */
        long bad = 0;
        for (int pass = 0; pass < 2; pass++) {
            if (pass == 0) {
                memset(out, 0, sizeof(double) * (size_t)count);
                MPI_Allreduce(in, out, (int)count, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
            } else {
                for (long i = 0; i < warmup; i++)
                    MPI_Allreduce(in, out, (int)count, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
                for (long i = 0; i < iterations; i++) {
                    MPI_Barrier(MPI_COMM_WORLD);
                    double start = MPI_Wtime();
                    MPI_Allreduce(in, out, (int)count, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
                    times[i] = MPI_Wtime() - start;
                }
            }
            for (long i = 0; i < count; i++) {
                double expected = 0;
                for (int r = 0; r < ranks; r++)
                    expected += contribution(r, i);
                bad += out[i] != expected;
            }
        }
        max_over_ranks(times, iterations);
        bad = tally_mismatches(bad);
        print_collective("allreduce", o->sizes[s], iterations, warmup, times, bad, 1);
    }
    free(times);
    free(out);
    free(in);
}

/* -------------------------------------------------------------------- main */

int main(int argc, char **argv) {
    start_mpi(&argc, &argv);
    if (argc < 2)
        usage_exit("no mode");
    const char *mode = argv[1];

    struct options o;
    memset(&o, 0, sizeof o);
    default_sweep(&o.sweep, 8, 16L << 20);
    o.repeats = 10;
    o.posted[0] = 1;
    o.posted[1] = 600;
    o.n_posted = 2;
    o.reverse = o.in_order = 1;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v;
        if (parse_sweep_argument(a, &o.sweep))
            continue;
        if ((v = value_of(a, "posted")))
            o.n_posted = parse_list(v, o.posted);
        else if ((v = value_of(a, "repeats")))
            o.repeats = strtol(v, NULL, 10);
        else if (!strcmp(a, "order=reverse"))
            o.reverse = 1, o.in_order = 0;
        else if (!strcmp(a, "order=in_order"))
            o.reverse = 0, o.in_order = 1;
        else if (!strcmp(a, "order=both"))
            o.reverse = o.in_order = 1;
        else
            unknown_argument(a);
    }
    check_sweep(&o.sweep);
    if (o.repeats <= 0 || o.n_posted == 0)
        usage_exit("repeats is positive, posted lists at least one count");
    check_message_sizes(&o.sweep);

    int two_ranks = !strcmp(mode, "pingpong") || !strcmp(mode, "preposted");
    if (two_ranks && ranks != 2)
        usage_exit("pingpong and preposted need exactly 2 ranks");

    if (!strcmp(mode, "pingpong"))
        run_pingpong_sweep(&o.sweep, print_pingpong);
    else if (!strcmp(mode, "preposted"))
        run_preposted(&o);
    else if (!strcmp(mode, "barrier"))
        run_barrier(&o.sweep);
    else if (!strcmp(mode, "bcast"))
        run_bcast(&o.sweep);
    else if (!strcmp(mode, "allreduce"))
        run_allreduce(&o.sweep);
    else
        usage_exit("unknown mode");
    return finish(mode);
}
