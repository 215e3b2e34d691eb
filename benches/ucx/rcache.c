/*
 * rcache.c: the UCX peer of `pin-cost`. UCX's registration cache
 * (`ucs_rcache` of libucs, the cache UCX's transports put in front of
 * memory registration) with mem_reg/mem_dereg callbacks that pin with
 * mlock(2) and unpin with munlock(2): the pin operation of pindown's
 * `MlockPinner`. `benches/src/ucx.rs` writes this file to a temporary folder,
 * compiles it with `cc -O2 ... -lucs -lucm` and runs it.
 *
 * For each region size in pages (argument pages=1,2,4,...), on the start
 * of one anonymous mapping, interleaved repetitions of:
 *   raw:        mlock + munlock of the region, timed apart (the limit);
 *   miss:       ucs_rcache_get of the region, not cached (registers it:
 *               mem_reg, one mlock), then ucs_rcache_region_put (the region
 *               stays cached, idle) -- pindown's `pin` miss plus release;
 *   invalidate: ucs_rcache_region_invalidate of the idle region (deregisters
 *               it: mem_dereg, one munlock) -- pindown's `invalidate`;
 * then hits: get + put of the cached region, timed in batches.
 *
 * Checks (each failure exits 1 with an "error" line): every miss registered
 * exactly once and every invalidate deregistered exactly once; a hit never
 * registers and returns the cached region; the process's locked memory
 * (VmLck) grows by the region's bytes on a miss and is back where it was
 * after the invalidate.
 *
 * The cache is created as UCX's transports create theirs: page alignment,
 * UCM_EVENT_VM_UNMAPPED (invalidation on munmap through UCM's hooks), no
 * limit on regions or bytes.
 *
 * Arguments (key=value): pages=LIST min_reps=N max_reps=N budget_ms=N
 * hit_batch=N hit_batches=N. Output on stdout, one JSON object a line:
 *   {"kind":"header",...}  then one {"kind":"size",...} per size, then
 *   {"kind":"done"}.  Times are medians: microseconds, hits in nanoseconds.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <ucm/api/ucm.h>
#include <ucp/api/ucp_version.h>
#include <ucs/memory/rcache.h>
#include <ucs/type/status.h>

#define MAX_SIZES 64

static unsigned long regs, deregs;

static void fail(const char *what, const char *detail)
{
    printf("{\"kind\":\"error\",\"message\":\"%s: %s\"}\n", what, detail);
    fflush(stdout);
    exit(1);
}

/* mem_reg: pin the (page-aligned) region as MlockPinner does. */
static ucs_status_t mem_reg(void *context, ucs_rcache_t *rcache, void *arg,
                            ucs_rcache_region_t *region, uint16_t flags)
{
    (void)context;
    (void)rcache;
    (void)arg;
    (void)flags;
    if (mlock((void *)region->super.start,
              region->super.end - region->super.start) != 0) {
        return UCS_ERR_IO_ERROR;
    }
    ++regs;
    return UCS_OK;
}

/* mem_dereg: unpin it. */
static void mem_dereg(void *context, ucs_rcache_t *rcache,
                      ucs_rcache_region_t *region)
{
    (void)context;
    (void)rcache;
    munlock((void *)region->super.start, region->super.end - region->super.start);
    ++deregs;
}

static void dump_region(void *context, ucs_rcache_t *rcache,
                        ucs_rcache_region_t *region, char *buf, size_t max)
{
    (void)context;
    (void)rcache;
    (void)region;
    snprintf(buf, max, "mlock");
}

static const ucs_rcache_ops_t ops = {
    .mem_reg     = mem_reg,
    .mem_dereg   = mem_dereg,
    .dump_region = dump_region,
};

/* Invalidation completion: nothing to do, the program waits for nothing. */
static void invalidated(void *arg)
{
    (void)arg;
}

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *values, size_t n)
{
    qsort(values, n, sizeof(*values), by_value);
    return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

/* VmLck of /proc/self/status, in bytes. */
static long locked_bytes(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    if (f == NULL) {
        fail("open /proc/self/status", strerror(errno));
    }
    while (fgets(line, sizeof(line), f) != NULL) {
        if (sscanf(line, "VmLck: %ld kB", &kib) == 1) {
            break;
        }
    }
    fclose(f);
    if (kib < 0) {
        fail("/proc/self/status", "no VmLck");
    }
    return kib * 1024;
}

static unsigned long number(const char *arg, const char *key)
{
    char *end;
    unsigned long value = strtoul(arg + strlen(key), &end, 10);
    if (*end != '\0' || end == arg + strlen(key)) {
        fail("bad argument", arg);
    }
    return value;
}

int main(int argc, char **argv)
{
    unsigned long pages[MAX_SIZES];
    size_t sizes = 0;
    unsigned long min_reps = 11, max_reps = 201, budget_ms = 40;
    unsigned long hit_batch = 1000, hit_batches = 31;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    ucs_rcache_params_t params;
    ucs_rcache_t *rcache;
    ucs_status_t status;
    unsigned long largest = 0;
    char *base;
    int i;

    for (i = 1; i < argc; ++i) {
        const char *arg = argv[i];
        if (strncmp(arg, "pages=", 6) == 0) {
            char *list = strdup(arg + 6), *item, *save = NULL;
            for (item = strtok_r(list, ",", &save); item != NULL;
                 item = strtok_r(NULL, ",", &save)) {
                char *end;
                if (sizes == MAX_SIZES) {
                    fail("too many sizes", arg);
                }
                pages[sizes] = strtoul(item, &end, 10);
                if (*end != '\0' || pages[sizes] == 0) {
                    fail("bad size", item);
                }
                if (pages[sizes] > largest) {
                    largest = pages[sizes];
                }
                ++sizes;
            }
            free(list);
        } else if (strncmp(arg, "min_reps=", 9) == 0) {
            min_reps = number(arg, "min_reps=");
        } else if (strncmp(arg, "max_reps=", 9) == 0) {
            max_reps = number(arg, "max_reps=");
        } else if (strncmp(arg, "budget_ms=", 10) == 0) {
            budget_ms = number(arg, "budget_ms=");
        } else if (strncmp(arg, "hit_batch=", 10) == 0) {
            hit_batch = number(arg, "hit_batch=");
        } else if (strncmp(arg, "hit_batches=", 12) == 0) {
            hit_batches = number(arg, "hit_batches=");
        } else {
            fail("unknown argument", arg);
        }
    }
    if (sizes == 0 || min_reps == 0 || max_reps < min_reps || hit_batch == 0 ||
        hit_batches == 0) {
        fail("usage", "pages=LIST [min_reps=N max_reps=N budget_ms=N "
                      "hit_batch=N hit_batches=N]");
    }

    base = mmap(NULL, largest * page, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
        fail("mmap", strerror(errno));
    }
    memset(base, 1, largest * page);

    memset(&params, 0, sizeof(params));
    params.region_struct_size = sizeof(ucs_rcache_region_t);
    params.alignment          = page;
    params.max_alignment      = page;
    params.ucm_events         = UCM_EVENT_VM_UNMAPPED;
    params.ucm_event_priority = 1000;
    params.ops                = &ops;
    params.context            = NULL;
    params.flags              = 0;
    params.max_regions        = (unsigned long)-1;
    params.max_size           = (size_t)-1;
    params.max_unreleased     = (size_t)-1;
    status = ucs_rcache_create(&params, "pin-cost", NULL, &rcache);
    if (status != UCS_OK) {
        fail("ucs_rcache_create", ucs_status_string(status));
    }

    printf("{\"kind\":\"header\",\"ucx_api\":\"%d.%d\",\"page_size\":%zu,"
           "\"ucm_events\":\"vm_unmapped\",\"pin\":\"mlock\"}\n",
           UCP_API_MAJOR, UCP_API_MINOR, page);
    fflush(stdout);

    for (size_t s = 0; s < sizes; ++s) {
        size_t len = pages[s] * page;
        double *lock = calloc(max_reps, sizeof(double));
        double *unlock = calloc(max_reps, sizeof(double));
        double *raw = calloc(max_reps, sizeof(double));
        double *miss = calloc(max_reps, sizeof(double));
        double *inval = calloc(max_reps, sizeof(double));
        double *miss_inval = calloc(max_reps, sizeof(double));
        double *hits = calloc(hit_batches, sizeof(double));
        double started = now_ns(), budget = (double)budget_ms * 1e6;
        long locked_before = locked_bytes();
        unsigned long n = 0, b;
        ucs_rcache_region_t *region, *again;

        if (!lock || !unlock || !raw || !miss || !inval || !miss_inval || !hits) {
            fail("calloc", strerror(errno));
        }
        while (n < min_reps || (n < max_reps && now_ns() - started < budget)) {
            unsigned long regs_before = regs, deregs_before = deregs;
            double t0, t1, t2;

            t0 = now_ns();
            if (mlock(base, len) != 0) {
                fail("mlock", strerror(errno));
            }
            t1 = now_ns();
            munlock(base, len);
            t2 = now_ns();
            lock[n] = (t1 - t0) / 1e3;
            unlock[n] = (t2 - t1) / 1e3;
            raw[n] = (t2 - t0) / 1e3;

            t0 = now_ns();
            status = ucs_rcache_get(rcache, base, len, PROT_READ | PROT_WRITE,
                                    NULL, &region);
            if (status != UCS_OK) {
                fail("ucs_rcache_get (miss)", ucs_status_string(status));
            }
            ucs_rcache_region_put(rcache, region);
            t1 = now_ns();
            if (n == 0 && locked_bytes() - locked_before != (long)len) {
                fail("miss", "VmLck did not grow by the region's bytes");
            }
            /* The region is idle and cached: the page table holds it. */
            ucs_rcache_region_invalidate(rcache, region, invalidated, NULL);
            t2 = now_ns();
            miss[n] = (t1 - t0) / 1e3;
            inval[n] = (t2 - t1) / 1e3;
            miss_inval[n] = (t2 - t0) / 1e3;
            if (regs != regs_before + 1 || deregs != deregs_before + 1) {
                fail("miss", "not one registration and one deregistration");
            }
            if (n == 0 && locked_bytes() != locked_before) {
                fail("invalidate", "VmLck is not back where it was");
            }
            ++n;
        }

        /* Hits: register once, then time batches of get + put. */
        status = ucs_rcache_get(rcache, base, len, PROT_READ | PROT_WRITE, NULL,
                                &region);
        if (status != UCS_OK) {
            fail("ucs_rcache_get (warm)", ucs_status_string(status));
        }
        ucs_rcache_region_put(rcache, region);
        {
            unsigned long regs_before = regs;
            for (b = 0; b < hit_batches; ++b) {
                unsigned long k;
                double t0 = now_ns();
                for (k = 0; k < hit_batch; ++k) {
                    status = ucs_rcache_get(rcache, base, len,
                                            PROT_READ | PROT_WRITE, NULL, &again);
                    if (status != UCS_OK || again != region) {
                        fail("hit", "get did not return the cached region");
                    }
                    ucs_rcache_region_put(rcache, again);
                }
                hits[b] = (now_ns() - t0) / (double)hit_batch;
            }
            if (regs != regs_before) {
                fail("hit", "a hit registered");
            }
        }
        ucs_rcache_region_invalidate(rcache, region, invalidated, NULL);
        if (locked_bytes() != locked_before) {
            fail("invalidate after hits", "VmLck is not back where it was");
        }

        {
            double raw_mlock = median(lock, n), miss_us = median(miss, n);
            printf("{\"kind\":\"size\",\"pages\":%lu,\"bytes\":%zu,\"reps\":%lu,"
                   "\"miss_us\":%.4f,\"invalidate_us\":%.4f,"
                   "\"miss_plus_invalidate_us\":%.4f,\"raw_mlock_us\":%.4f,"
                   "\"raw_munlock_us\":%.4f,\"raw_mlock_munlock_us\":%.4f,"
                   "\"miss_overhead_us\":%.4f,\"hit_ns\":%.4f,"
                   "\"hit_batches\":%lu,\"verified\":true}\n",
                   pages[s], len, n, miss_us, median(inval, n),
                   median(miss_inval, n), raw_mlock, median(unlock, n),
                   median(raw, n), miss_us - raw_mlock,
                   median(hits, hit_batches), hit_batches);
            fflush(stdout);
        }
        free(lock);
        free(unlock);
        free(raw);
        free(miss);
        free(inval);
        free(miss_inval);
        free(hits);
    }

    ucs_rcache_destroy(rcache);
    munmap(base, largest * page);
    printf("{\"kind\":\"done\",\"registrations\":%lu,\"deregistrations\":%lu}\n",
           regs, deregs);
    return 0;
}
