/* host_heap.c: keep_host_heap and trim_host_heap, glibc's heap tuned for the engine's CPU
 * buffers ([Note: host heap trim]). Process-wide, like the heap itself. */
#include "pieces.h"

#include <stdio.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

/* [Note: host heap trim]
 * On CPU the process's resident memory grew 665 MiB over 135 training steps of a 22 MB model
 * (ZeRO-1, 2 ranks) and was still growing; all of it was free to malloc (malloc_trim gave it
 * back), and pinning glibc's mmap threshold also stopped it: heap fragmentation once glibc's
 * dynamic threshold serves activation-sized blocks from the heap between collectives' buffers.
 * Pinning the threshold cost 20-28% step time. Instead, after a backward, the heap is trimmed
 * when resident memory has grown by more than a bound over its level one backward after the
 * last trim (the step after a trim faults its working set back in; measuring from right after
 * the trim would trim again at once): one /proc read per backward, one trim every so many
 * steps. (Not malloc's free-byte count: trimmed pages stay free chunks, so that count never
 * drops and would trim at every backward.)
 * The trim is also what lets the heap keep freed blocks between trims: every gather allocates
 * and frees buffers of the same few sizes (the gathered bucket and its copy-out target), and
 * glibc's default gives them back to the OS as they are freed, so the next gather faults fresh,
 * kernel-zeroed pages in -- half the time of a ZeRO-3 gather on the benchmark's CPU. So
 * keep_host_heap serves blocks up to 32 MiB (glibc's largest mmap threshold) from the heap and
 * leaves freed memory there for reuse; the trim above bounds what is kept. */
static long long resident_bytes(void) {
  long long pages = -1, resident = -1;
  FILE* f = fopen("/proc/self/statm", "r");
  if (f == NULL) return -1;
  int n = fscanf(f, "%lld %lld", &pages, &resident);
  fclose(f);
  return n == 2 ? resident * (long long)sysconf(_SC_PAGESIZE) : -1;
}

static long long g_resident_after_trim; /* process-wide, like the heap; updated under the GIL */

static PyObject* py_trim_host_heap(PyObject* module, PyObject* arg) {
  (void)module;
  long long bound = PyLong_AsLongLong(arg);
  if (bound == -1 && PyErr_Occurred()) return NULL;
#if defined(__GLIBC__)
  long long now = resident_bytes();
  if (now < 0) return PyLong_FromLong(-1);
  if (g_resident_after_trim == 0 || now < g_resident_after_trim) g_resident_after_trim = now;
  if (now - g_resident_after_trim <= bound) return PyLong_FromLong(0);
  Py_BEGIN_ALLOW_THREADS
  malloc_trim(0);
  Py_END_ALLOW_THREADS
  long long after = resident_bytes();
  g_resident_after_trim = 0; /* the next backward sets it, once the working set is back in */
  return PyLong_FromLongLong(now - after);
#else
  return PyLong_FromLong(-1); /* not glibc: nothing to do */
#endif
}

static PyObject* py_keep_host_heap(PyObject* module, PyObject* unused) {
  (void)module;
  (void)unused;
#if defined(__GLIBC__)
  static int done = 0; /* process-wide: once */
  if (!done) {
    done = mallopt(M_MMAP_THRESHOLD, 32 << 20) && mallopt(M_TRIM_THRESHOLD, 1 << 30);
    if (!done) return PyLong_FromLong(-1);
  }
  return PyLong_FromLong(1);
#else
  return PyLong_FromLong(-1);
#endif
}

static PyMethodDef host_heap_methods[] = {
    {"keep_host_heap", py_keep_host_heap, METH_NOARGS,
     "keep_host_heap() -> 1: glibc keeps freed blocks up to 32 MiB for reuse (process-wide, once; -1: not glibc). "
     "Pair it with trim_host_heap. See [Note: host heap trim]."},
    {"trim_host_heap", py_trim_host_heap, METH_O,
     "trim_host_heap(bound) -> resident bytes given back to the OS: trims the heap once resident memory grew "
     "by more than bound since the last trim (0: not yet, -1: not glibc/Linux). See [Note: host heap trim]."},
    {NULL, NULL, 0, NULL},
};

int mfsdp_register_host_heap(PyObject* module, module_state* st) {
  (void)st;
  return PyModule_AddFunctions(module, host_heap_methods);
}
