/* Stream links, windows and n-step rows for conduit_dist.sampling.sequences (its docstring has
 * the model: items keyed by generation g, slot g % cap; prev/next links within a stream, never
 * across an episode end). The callers pass raw addresses of contiguous host tensors they keep
 * alive for the call; sizes are checked here before any byte is touched. */
#include "seq.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

/* seq_windows(next, cap, starts, k, L, out, m): for each of k start generations, its window of
 * up to L generations following next[g % cap] (int64, -1: none, which an item that ends an
 * episode always has); out[k, L] repeats the last item past the window's end and m[k] receives
 * each window's length. */
PyObject* seq_windows(PyObject* self, PyObject* args) {
    unsigned long long next_p, starts_p, out_p, m_p;
    long long cap, k, L;
    if (!PyArg_ParseTuple(args, "KLKLLKK", &next_p, &cap, &starts_p, &k, &L, &out_p, &m_p))
        return NULL;
    if (cap < 1 || L < 1 || k < 0) {
        PyErr_Format(PyExc_ValueError, "seq_windows: expected cap >= 1, L >= 1, k >= 0, got "
                     "cap=%lld, L=%lld, k=%lld", cap, L, k);
        return NULL;
    }
    const int64_t* nxt = (const int64_t*)(uintptr_t)next_p;
    const int64_t* starts = (const int64_t*)(uintptr_t)starts_p;
    int64_t* out = (int64_t*)(uintptr_t)out_p;
    int64_t* m = (int64_t*)(uintptr_t)m_p;
    /* windows advance in groups, step by step, each prefetching its next link: the misses of
     * a group overlap instead of following one chain at a time */
    enum { WGROUP = 16 };
    int64_t g[WGROUP], len[WGROUP];
    int alive[WGROUP];
    for (long long at = 0; at < k; at += WGROUP) {
        int g_n = k - at < WGROUP ? (int)(k - at) : WGROUP;
        for (int w = 0; w < g_n; w++) {
            g[w] = starts[at + w];
            len[w] = 1;
            alive[w] = 1;
            out[(at + w) * L] = g[w];
            __builtin_prefetch(&nxt[g[w] % cap]);
        }
        for (long long j = 1; j < L; j++) {
            for (int w = 0; w < g_n; w++) {
                if (alive[w]) {
                    int64_t n = nxt[g[w] % cap]; /* -1 after an episode's end: never linked */
                    if (n < 0) alive[w] = 0;
                    else {
                        g[w] = n;
                        len[w]++;
                        __builtin_prefetch(&nxt[n % cap]);
                    }
                }
                out[(at + w) * L + j] = g[w];
            }
        }
        for (int w = 0; w < g_n; w++) m[at + w] = len[w];
    }
    Py_RETURN_NONE;
}

/* Walk *g up to steps live links back through prev (a link counts only while its item is live:
 * gen[p % cap] == p); returns whether all steps were taken, *g the last item reached. */
static inline int walk_back(const int64_t* prev, const int64_t* gen, long long cap, int64_t* g,
                            long long steps) {
    for (long long s = 0; s < steps; s++) {
        int64_t p = prev[*g % cap];
        if (p < 0 || gen[p % cap] != p) return 0;
        *g = p;
    }
    return 1;
}

/* The item steps live links back from g, or -1 where the walk breaks. */
static inline int64_t back_from(const int64_t* prev, const int64_t* gen, long long cap, int64_t g,
                                long long steps) {
    return walk_back(prev, gen, cap, &g, steps) ? g : -1;
}

/* seq_back(prev, gen, cap, g, n, steps, out, ok): for each of n generations, the item steps
 * links back through prev[g % cap] (int64, -1: none) into out, and ok[i] (uint8) = whether it
 * exists: every item on the way must still be live (gen[p % cap] == p; a slot reused by a newer
 * item holds that item's links). out is then the last item reached. */
PyObject* seq_back(PyObject* self, PyObject* args) {
    unsigned long long prev_p, gen_p, g_p, out_p, ok_p;
    long long cap, n, steps;
    if (!PyArg_ParseTuple(args, "KKLKLLKK", &prev_p, &gen_p, &cap, &g_p, &n, &steps, &out_p,
                          &ok_p))
        return NULL;
    if (cap < 1 || n < 0 || steps < 0) {
        PyErr_Format(PyExc_ValueError, "seq_back: expected cap >= 1, n >= 0, steps >= 0, got "
                     "cap=%lld, n=%lld, steps=%lld", cap, n, steps);
        return NULL;
    }
    const int64_t* prev = (const int64_t*)(uintptr_t)prev_p;
    const int64_t* gen = (const int64_t*)(uintptr_t)gen_p;
    const int64_t* gs = (const int64_t*)(uintptr_t)g_p;
    int64_t* out = (int64_t*)(uintptr_t)out_p;
    uint8_t* ok = (uint8_t*)(uintptr_t)ok_p;
    for (long long i = 0; i < n; i++) {
        int64_t g = gs[i];
        ok[i] = (uint8_t)walk_back(prev, gen, cap, &g, steps);
        out[i] = g;
    }
    Py_RETURN_NONE;
}

static inline int live(const int64_t* gen, long long cap, int64_t g) {
    return g >= 0 && gen[g % cap] == g;
}

/* seq_starts(prev, gen, end, cap, gens, n, L, cut, out) -> k: the starts whose window the n new
 * items gens complete, into out (room for n * L), in the order of Episodes._starts: first the
 * item L - 1 live links back from each new item, then (cut: n-step windows an episode end cuts
 * short) for back = 0 .. L - 2, the item back links before each new item that ends an episode
 * (end[g % cap], uint8); only starts still live. One pass where the NumPy version made a dozen
 * small arrays a round. */
PyObject* seq_starts(PyObject* self, PyObject* args) {
    unsigned long long prev_p, gen_p, end_p, g_p, out_p;
    long long cap, n, L;
    int cut;
    if (!PyArg_ParseTuple(args, "KKKLKLLpK", &prev_p, &gen_p, &end_p, &cap, &g_p, &n, &L, &cut,
                          &out_p))
        return NULL;
    if (cap < 1 || n < 0 || L < 1) {
        PyErr_Format(PyExc_ValueError, "seq_starts: expected cap >= 1, n >= 0, L >= 1, got "
                     "cap=%lld, n=%lld, L=%lld", cap, n, L);
        return NULL;
    }
    const int64_t* prev = (const int64_t*)(uintptr_t)prev_p;
    const int64_t* gen = (const int64_t*)(uintptr_t)gen_p;
    const uint8_t* end = (const uint8_t*)(uintptr_t)end_p;
    const int64_t* gs = (const int64_t*)(uintptr_t)g_p;
    int64_t* out = (int64_t*)(uintptr_t)out_p;
    long long k = 0;
    for (long long i = 0; i < n; i++) {
        if (gs[i] < 0) continue;  /* not an item (C's % of a negative number is negative) */
        int64_t s = back_from(prev, gen, cap, gs[i], L - 1);
        if (s >= 0 && live(gen, cap, s)) out[k++] = s;
    }
    if (cut)
        for (long long back = 0; back < L - 1; back++)
            for (long long i = 0; i < n; i++) {
                int64_t g = gs[i];
                if (g < 0 || !end[g % cap]) continue;
                int64_t s = back_from(prev, gen, cap, g, back);
                if (s >= 0 && live(gen, cap, s)) out[k++] = s;
            }
    return PyLong_FromLongLong(k);
}

/* An int field of a record: kind 1, 2, 4, 8 signed bytes; 17 uint8. */
static inline int64_t read_int(const uint8_t* p, int kind) {
    switch (kind) {
    case 1: { int8_t v; memcpy(&v, p, 1); return v; }
    case 2: { int16_t v; memcpy(&v, p, 2); return v; }
    case 4: { int32_t v; memcpy(&v, p, 4); return v; }
    case 8: { int64_t v; memcpy(&v, p, 8); return v; }
    default: return (int64_t)p[0];
    }
}

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* seq_link(prev, next, gen, end, term, src, cap, gens, n, rows, rb, off_done, off_trunc,
 *          off_stream, stream_kind, sources, tab, tab_len): link n new items, in arrival order.
 *
 * rows [n, rb]: the items' records (done: a bool at off_done; truncated at off_trunc, -1:
 * none; the stream key at off_stream of stream_kind, -1: every source is one stream). sources
 * [n] int64: the rank that put each. For each item (leaf = g % cap): end/term/src set, next =
 * -1; then, item by item, prev = the newest item of its (source, key) stream, kept if it is
 * still live (gen[p % cap] == p) and does not end an episode, and the stream's newest becomes
 * the item. Streams live in tab (int64 [tab_len, 3]: source, key, newest; source INT64_MIN:
 * empty; open addressing, tab_len a power of two the caller keeps at least twice the streams
 * plus n). Returns how many streams were added. */
PyObject* seq_link(PyObject* self, PyObject* args) {
    unsigned long long prev_p, next_p, gen_p, end_p, term_p, src_p, gens_p, rows_p, sources_p,
        tab_p;
    long long cap, n, rb, off_done, off_trunc, off_stream, tab_len;
    int kind;
    if (!PyArg_ParseTuple(args, "KKKKKKLKLKLLLLiKKL", &prev_p, &next_p, &gen_p, &end_p, &term_p,
                          &src_p, &cap, &gens_p, &n, &rows_p, &rb, &off_done, &off_trunc,
                          &off_stream, &kind, &sources_p, &tab_p, &tab_len))
        return NULL;
    int kind_ok = kind == 1 || kind == 2 || kind == 4 || kind == 8 || kind == 17;
    int ksize = kind == 17 ? 1 : kind;
    if (cap < 1 || n < 0 || rb < 1 || off_done < 0 || off_done >= rb || off_trunc >= rb ||
        (off_stream >= 0 && (!kind_ok || off_stream + ksize > rb)) || tab_len < 2 ||
        (tab_len & (tab_len - 1)) || tab_len < 2 * n) {
        PyErr_Format(PyExc_ValueError,
                     "seq_link: expected cap >= 1, n >= 0, fields inside rb=%lld bytes, a stream "
                     "kind in {1, 2, 4, 8, 17} and tab_len a power of two >= 2n; got cap=%lld, "
                     "n=%lld, off_done=%lld, off_trunc=%lld, off_stream=%lld, kind=%d, "
                     "tab_len=%lld", rb, cap, n, off_done, off_trunc, off_stream, kind, tab_len);
        return NULL;
    }
    int64_t* prev = (int64_t*)(uintptr_t)prev_p;
    int64_t* nxt = (int64_t*)(uintptr_t)next_p;
    const int64_t* gen = (const int64_t*)(uintptr_t)gen_p;
    uint8_t* end = (uint8_t*)(uintptr_t)end_p;
    uint8_t* term = (uint8_t*)(uintptr_t)term_p;
    int32_t* src = (int32_t*)(uintptr_t)src_p;
    const int64_t* gens = (const int64_t*)(uintptr_t)gens_p;
    const uint8_t* rows = (const uint8_t*)(uintptr_t)rows_p;
    const int64_t* sources = (const int64_t*)(uintptr_t)sources_p;
    int64_t* tab = (int64_t*)(uintptr_t)tab_p;
    uint64_t mask = (uint64_t)tab_len - 1;
    long long added = 0;
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < n; i++) {
        const uint8_t* r = rows + i * rb;
        int64_t leaf = gens[i] % cap;
        uint8_t d = r[off_done] != 0;
        uint8_t t = off_trunc >= 0 && r[off_trunc] != 0;
        end[leaf] = d | t;
        term[leaf] = d;
        nxt[leaf] = -1;
        src[leaf] = (int32_t)sources[i];
    }
    for (long long i = 0; i < n; i++) {
        int64_t s = sources[i];
        int64_t key = off_stream >= 0 ? read_int(rows + i * rb + off_stream, kind) : 0;
        uint64_t h = mix64((uint64_t)s * 0x9E3779B97F4A7C15ULL ^ (uint64_t)key) & mask;
        while (tab[3 * h] != INT64_MIN && (tab[3 * h] != s || tab[3 * h + 1] != key))
            h = (h + 1) & mask;
        int64_t p = -1;
        if (tab[3 * h] == INT64_MIN) {
            tab[3 * h] = s;
            tab[3 * h + 1] = key;
            added++;
        } else {
            p = tab[3 * h + 2];
        }
        int64_t g = gens[i];
        tab[3 * h + 2] = g;
        int ok = p >= 0 && gen[p % cap] == p && !end[p % cap];
        prev[g % cap] = ok ? p : -1;
        if (ok) nxt[p % cap] = g;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(added);
}

/* seq_nstep(rows, k, L, rb, m, gens, term, cap, off_reward, gamma, out, out_stride, at): the
 * n-step part of k delivered rows. rows [k, L, rb]: each window's records (m[i] of them, the
 * last repeated after); gens [k, L] their generations. Row i of out (out_stride bytes apart)
 * gets the first record, then the window's last, and at byte at the float32 return
 * sum_{j < m} gamma^j r_j (float32 rewards at off_reward, summed in float64) and the discount
 * gamma^m (0 when the last item is terminal: term[g % cap]). */
PyObject* seq_nstep(PyObject* self, PyObject* args) {
    unsigned long long rows_p, m_p, gens_p, term_p, out_p;
    long long k, L, rb, cap, off_reward, out_stride, at;
    double gamma;
    if (!PyArg_ParseTuple(args, "KLLLKKKLLdKLL", &rows_p, &k, &L, &rb, &m_p, &gens_p, &term_p,
                          &cap, &off_reward, &gamma, &out_p, &out_stride, &at))
        return NULL;
    if (k < 0 || L < 1 || rb < 1 || cap < 1 || off_reward < 0 || off_reward + 4 > rb ||
        at < 2 * rb || at + 8 > out_stride) {
        PyErr_Format(PyExc_ValueError,
                     "seq_nstep: expected k >= 0, L >= 1, the reward inside rb=%lld bytes and "
                     "2 records + 8 bytes at %lld inside a row of %lld bytes; got k=%lld, "
                     "L=%lld, off_reward=%lld", rb, at, out_stride, k, L, off_reward);
        return NULL;
    }
    const uint8_t* rows = (const uint8_t*)(uintptr_t)rows_p;
    const int64_t* m = (const int64_t*)(uintptr_t)m_p;
    const int64_t* gens = (const int64_t*)(uintptr_t)gens_p;
    const uint8_t* term = (const uint8_t*)(uintptr_t)term_p;
    uint8_t* out = (uint8_t*)(uintptr_t)out_p;
    for (long long j = 0; j < k; j++)
        if (m[j] < 1 || m[j] > L) {
            PyErr_Format(PyExc_ValueError, "seq_nstep: window %lld has %lld items, expected 1..%lld",
                         j, (long long)m[j], L);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < k; i++) {
        const uint8_t* w = rows + i * L * rb;
        uint8_t* o = out + i * out_stride;
        long long last = m[i] - 1;
        memcpy(o, w, rb);
        memcpy(o + rb, w + last * rb, rb);
        double ret = 0.0, scale = 1.0;
        for (long long j = 0; j < m[i]; j++) {
            float r;
            memcpy(&r, w + j * rb + off_reward, 4);
            ret += (double)r * scale;
            scale *= gamma;
        }
        double disc = term[gens[i * L + last] % cap] ? 0.0 : pow(gamma, (double)m[i]);
        float vals[2] = {(float)ret, (float)disc};
        memcpy(o + at, vals, 8);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
