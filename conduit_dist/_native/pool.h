/* A few worker threads for the extension's large copies (pool.c), used by pack.c. */
#ifndef CONDUIT_POOL_H
#define CONDUIT_POOL_H
#include <stddef.h>

/* One part of a job: the caller splits its work into `parts` pieces and does piece `part`. */
typedef void (*pool_fn)(void* arg, size_t part, size_t parts);

/* The parts a copy of `nbytes` in `units` rows (or values) is split into with `threads` allowed:
 * 1 below 2 * part_bytes, else up to `threads` (at most 16) and `units`, each part at least
 * part_bytes (to within one unit). */
size_t pool_parts(size_t nbytes, size_t units, long threads, size_t part_bytes);

/* Part `part` of `parts` of n units: [lo, hi), the first n % parts parts one longer (no
 * n * part product: it cannot overflow). */
void pool_range(size_t n, size_t part, size_t parts, size_t* lo, size_t* hi);

/* Workers started in this process (0 in a child until its first split copy). */
size_t pool_workers(void);

/* The least a part of a copy (POOL_COPY) or of a NaN/inf scan (POOL_SCAN, which reads at several
 * times copy speed) is worth waking a worker for. */
#define POOL_COPY ((size_t)2 << 20)
#define POOL_SCAN ((size_t)4 << 20)

/* Run fn(arg, p, parts) for p in [0, parts): part 0 on the calling thread, the others on workers;
 * returns once every part has run. Call without the GIL. Parts no worker could be started for
 * run on the calling thread, after part 0; where another thread's job is running, the caller runs
 * fn(arg, 0, 1) instead: fn must cover its work for any number of parts. */
void pool_run(pool_fn fn, void* arg, size_t parts);

#endif
