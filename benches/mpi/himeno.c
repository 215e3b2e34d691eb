/*
 * himeno: the MPI side of the GASNet benchmark's Himeno run (paper: GASNet
 * on TCA/PEACH2, section 5.3, table 2), measured with a real MPI (Open MPI
 * or MPICH, whichever mpicc built this).
 *
 * The Himeno benchmark's kernel (RIKEN's himenoBMTxpa.c, single precision):
 * Jacobi iterations of a 19-point stencil for the 3-D Poisson equation on
 * arrays a[4], b[3], c[3], p, bnd, wrk1, wrk2 of NI x NJ x NK floats
 * (index (i * NJ + j) * NK + k), initialized as the original does:
 *   a[0..3] = 1, a[3] = 1/6, b = 0, c = 1, bnd = 1, wrk1 = wrk2 = 0,
 *   p(i, j, k) = i^2 / (NI - 2)^2   (i global),
 * omega = 0.8, interior points 1..N-2 in every dimension. One iteration
 * computes, for every interior point, s0 (the stencil), ss = (s0 * a[3] -
 * p) * bnd, gosa += ss^2 and wrk2 = p + omega * ss, then copies wrk2 into
 * p, exchanges p's halo and sums gosa over the ranks (MPI_Allreduce, float).
 *
 * Decomposition: 1-D over i (the paper's "i-direction" split): the NI - 2
 * interior planes are dealt in contiguous blocks (the first (NI-2) % R
 * ranks one more), each rank holding its planes plus a ghost plane on each
 * side. The halo exchange sends a rank's last interior plane to its right
 * neighbour's ghost 0 and its first one to its left neighbour's last
 * ghost (MPI_Sendrecv), each plane described by
 * MPI_Type_create_subarray (one i-plane of the local array: NJ x NK
 * contiguous floats). With one rank the run is the original serial
 * benchmark, gosa included.
 *
 * Usage: himeno [sizes=XS,S,M,L] [iterations=NN] [warmup=W]
 *   sizes       Himeno's grid names: XS 32x32x64, S 64x64x128,
 *               M 128x128x256, L 256x256x512 (i x j x k; default XS,S,M).
 *   iterations  timed Jacobi iterations per size (default 1000, the
 *               paper's), after W untimed ones (default 0) that start from
 *               the same initial state (the timed run starts afresh).
 * Output (rank 0, stdout): one JSON object per size and line:
 *   {"mpi", "test": "himeno", "ranks", "size", "ni", "nj", "nk",
 *    "iterations", "seconds", "iterations_per_s", "mflops" (Himeno's 34
 *    flops per point), "calc_s", "halo_s", "allreduce_s" (each the
 *    slowest rank's total), "gosa" (the last iteration's residual, as
 *    Himeno prints it), "p_sum" (sum of p over the interior after the run,
 *    in double: a second check)}.
 */
#define _GNU_SOURCE
#define PROGRAM "himeno"
#define USAGE "himeno [sizes=XS,S,M,L] [iterations=NN] [warmup=W]"
#include "common.h"

struct grid {
    const char *name;
    long ni, nj, nk;
};

static const struct grid grids[] = {
    {"XS", 32, 32, 64},
    {"S", 64, 64, 128},
    {"M", 128, 128, 256},
    {"L", 256, 256, 512},
};
#define GRIDS ((int)(sizeof grids / sizeof grids[0]))

/* This rank's share: `count` interior planes from global plane `first`. */
struct share {
    long first, count;
};

static struct share share_of(long ni, int r) {
    long interior = ni - 2, base = interior / ranks, extra = interior % ranks;
    struct share s;
    s.count = base + (r < extra);
    s.first = 1 + r * base + (r < extra ? r : extra);
    return s;
}

struct state {
    long li, nj, nk; /* local planes (with the two ghosts), j, k */
    long plane;      /* nj * nk */
    float *a[4], *b[3], *c[3], *p, *bnd, *wrk1, *wrk2;
};

#define AT(s, i, j, k) (((i) * (s)->nj + (j)) * (s)->nk + (k))

static void init(struct state *s, const struct grid *g, struct share sh) {
    s->li = sh.count + 2;
    s->nj = g->nj;
    s->nk = g->nk;
    s->plane = g->nj * g->nk;
    size_t n = (size_t)(s->li * s->plane);
    float **all[] = {&s->a[0], &s->a[1], &s->a[2], &s->a[3], &s->b[0], &s->b[1], &s->b[2],
                     &s->c[0], &s->c[1], &s->c[2], &s->p, &s->bnd, &s->wrk1, &s->wrk2};
    for (size_t m = 0; m < sizeof all / sizeof all[0]; m++)
        *all[m] = alloc_or_abort(sizeof(float) * n);
    float denominator = (float)((g->ni - 2) * (g->ni - 2));
    for (long i = 0; i < s->li; i++) {
        long gi = sh.first - 1 + i;
        for (long j = 0; j < s->nj; j++)
            for (long k = 0; k < s->nk; k++) {
                long x = AT(s, i, j, k);
                s->a[0][x] = s->a[1][x] = s->a[2][x] = 1.0f;
                s->a[3][x] = 1.0f / 6.0f;
                s->b[0][x] = s->b[1][x] = s->b[2][x] = 0.0f;
                s->c[0][x] = s->c[1][x] = s->c[2][x] = 1.0f;
                s->p[x] = (float)(gi * gi) / denominator;
                s->wrk1[x] = 0.0f;
                s->wrk2[x] = 0.0f;
                s->bnd[x] = 1.0f;
            }
    }
}

static void release(struct state *s) {
    float *all[] = {s->a[0], s->a[1], s->a[2], s->a[3], s->b[0], s->b[1], s->b[2],
                    s->c[0], s->c[1], s->c[2], s->p,    s->bnd,  s->wrk1, s->wrk2};
    for (size_t m = 0; m < sizeof all / sizeof all[0]; m++)
        free(all[m]);
}

/* One Jacobi sweep over this rank's interior; returns its part of gosa. */
static float sweep(struct state *s) {
    const float omega = 0.8f;
    float gosa = 0.0f;
    float *p = s->p;
    long nj = s->nj, nk = s->nk;
    for (long i = 1; i < s->li - 1; i++)
        for (long j = 1; j < nj - 1; j++)
            for (long k = 1; k < nk - 1; k++) {
                long x = AT(s, i, j, k);
                long ip = x + s->plane, im = x - s->plane, jp = x + nk, jm = x - nk;
                float s0 = s->a[0][x] * p[ip] + s->a[1][x] * p[jp] + s->a[2][x] * p[x + 1] +
                           s->b[0][x] * (p[ip + nk] - p[ip - nk] - p[im + nk] + p[im - nk]) +
                           s->b[1][x] * (p[jp + 1] - p[jm + 1] - p[jp - 1] + p[jm - 1]) +
                           s->b[2][x] * (p[ip + 1] - p[im + 1] - p[ip - 1] + p[im - 1]) +
                           s->c[0][x] * p[im] + s->c[1][x] * p[jm] + s->c[2][x] * p[x - 1] +
                           s->wrk1[x];
                float ss = (s0 * s->a[3][x] - p[x]) * s->bnd[x];
                gosa += ss * ss;
                s->wrk2[x] = p[x] + omega * ss;
            }
    for (long i = 1; i < s->li - 1; i++)
        for (long j = 1; j < nj - 1; j++)
            for (long k = 1; k < nk - 1; k++)
                p[AT(s, i, j, k)] = s->wrk2[AT(s, i, j, k)];
    return gosa;
}

/* The halo exchange of p: last interior plane right, first one left. */
static void exchange(struct state *s, MPI_Datatype plane) {
    int left = rank > 0 ? rank - 1 : MPI_PROC_NULL;
    int right = rank < ranks - 1 ? rank + 1 : MPI_PROC_NULL;
    float *p = s->p;
    long last = s->li - 1;
    MPI_Sendrecv(p + (last - 1) * s->plane, 1, plane, right, 1, p, 1, plane, left, 1,
                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Sendrecv(p + s->plane, 1, plane, left, 2, p + last * s->plane, 1, plane, right, 2,
                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
}

struct times {
    double calc, halo, allreduce;
};

static float iterate(struct state *s, MPI_Datatype plane, long nn, struct times *t) {
    float gosa = 0.0f;
    for (long n = 0; n < nn; n++) {
        double t0 = MPI_Wtime();
        float mine = sweep(s);
        double t1 = MPI_Wtime();
        exchange(s, plane);
        double t2 = MPI_Wtime();
        MPI_Allreduce(&mine, &gosa, 1, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double t3 = MPI_Wtime();
        t->calc += t1 - t0;
        t->halo += t2 - t1;
        t->allreduce += t3 - t2;
    }
    return gosa;
}

static void run(const struct grid *g, long nn, long warmup) {
    if (g->ni - 2 < ranks)
        usage_exit("more ranks than interior i-planes");
    struct share sh = share_of(g->ni, rank);
    struct state s;
    MPI_Datatype plane;
    int sizes[3] = {(int)(sh.count + 2), (int)g->nj, (int)g->nk};
    int subsizes[3] = {1, (int)g->nj, (int)g->nk};
    int starts[3] = {0, 0, 0};
    MPI_Type_create_subarray(3, sizes, subsizes, starts, MPI_ORDER_C, MPI_FLOAT, &plane);
    MPI_Type_commit(&plane);
    struct times t = {0, 0, 0};
    if (warmup > 0) {
        init(&s, g, sh);
        iterate(&s, plane, warmup, &t);
        release(&s);
        t = (struct times){0, 0, 0};
    }
    init(&s, g, sh);
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    float gosa = iterate(&s, plane, nn, &t);
    MPI_Barrier(MPI_COMM_WORLD);
    double seconds = MPI_Wtime() - start;
    double p_sum = 0, all_p_sum = 0;
    for (long i = 1; i < s.li - 1; i++)
        for (long j = 1; j < s.nj - 1; j++)
            for (long k = 1; k < s.nk - 1; k++)
                p_sum += s.p[AT(&s, i, j, k)];
    MPI_Reduce(&p_sum, &all_p_sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    double phases[3] = {t.calc, t.halo, t.allreduce}, slowest[3];
    MPI_Reduce(phases, slowest, 3, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    release(&s);
    MPI_Type_free(&plane);
    if (rank == 0) {
        double points = (double)(g->ni - 2) * (double)(g->nj - 2) * (double)(g->nk - 2);
        begin_figure("himeno");
        printf("\"ranks\": %d, \"size\": \"%s\", \"ni\": %ld, \"nj\": %ld, \"nk\": %ld, "
               "\"iterations\": %ld, \"warmup\": %ld, \"seconds\": %.6f, "
               "\"iterations_per_s\": %.3f, \"mflops\": %.3f, \"calc_s\": %.6f, \"halo_s\": %.6f, "
               "\"allreduce_s\": %.6f, \"gosa\": %.9e, \"p_sum\": %.12e",
               ranks, g->name, g->ni, g->nj, g->nk, nn, warmup, seconds,
               (double)nn / seconds, 34.0 * points * (double)nn / seconds / 1e6, slowest[0],
               slowest[1], slowest[2], (double)gosa, all_p_sum);
        end_figure();
    }
}

int main(int argc, char **argv) {
    start_mpi(&argc, &argv);
    int chosen[GRIDS] = {1, 1, 1, 0};
    const char *grid_names[GRIDS];
    for (int g = 0; g < GRIDS; g++)
        grid_names[g] = grids[g].name;
    long nn = 1000, warmup = 0; /* the paper's iterations */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if ((v = value_of(a, "sizes")))
            parse_names(v, grid_names, GRIDS, chosen);
        else if ((v = value_of(a, "iterations")))
            nn = strtol(v, NULL, 10);
        else if ((v = value_of(a, "warmup")))
            warmup = strtol(v, NULL, 10);
        else
            unknown_argument(a);
    }
    check_iterations(nn, warmup);
    for (int g = 0; g < GRIDS; g++)
        if (chosen[g])
            run(&grids[g], nn, warmup);
    return finish(NULL);
}
