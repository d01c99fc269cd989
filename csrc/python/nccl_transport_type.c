/* nccl_transport_type.c: megatron_fsdp_c._C.NcclTransport, the Python type of the native NCCL
 * transport (csrc/cuda/nccl_transport.c, which includes no Python), and the NCCL facts Python
 * needs: nccl_unique_id, nccl_version, NCCL_BUILD_VERSION. A CPU-only build compiles only the
 * no-op register function at the end. */
#include "pieces.h"

#ifdef MFSDP_WITH_CUDA
#include <string.h>
#include <time.h>

#include "../cuda/mfsdp_nccl.h"

typedef struct nccl_object {
  transport_object head;
  mfsdp_nccl* nccl;
  double last_signal_check; /* monotonic seconds; see nccl_interrupted */
} nccl_object;

PyDoc_STRVAR(nccl_doc,
             "NcclTransport(gather_id, reduce_id, rank, world, device, timeout=None)\n\n"
             "Our own NCCL communicators (one for all-gathers, one for reductions) and streams.\n"
             "The ids come from nccl_unique_id() on rank 0, broadcast to all ranks. timeout:\n"
             "seconds after which an unfinished collective (or the set-up, or close) aborts the\n"
             "communicators and raises; None: no timeout. Call close() on every rank at the same\n"
             "point to end it; a transport dropped without close aborts its communicators.");

/* While the transport waits for NCCL (see [Note: NCCL never blocks the engine] in
 * csrc/cuda/nccl_watch.c): the GIL is released, if this thread holds it, and Ctrl-C is
 * looked for every 20 ms. A KeyboardInterrupt ends the wait (the transport aborts its
 * communicators and fails) and is raised again once the call is back in Python. */
static void* nccl_block_begin(void* arg) {
  (void)arg;
  return PyGILState_Check() ? (void*)PyEval_SaveThread() : NULL;
}

static void nccl_block_end(void* arg, void* token) {
  (void)arg;
  if (token) PyEval_RestoreThread((PyThreadState*)token);
}

static double monotonic_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int nccl_interrupted(void* arg) {
  nccl_object* o = arg;
  double now = monotonic_s();
  if (now - o->last_signal_check < 0.02) return 0;
  o->last_signal_check = now;
  PyGILState_STATE g = PyGILState_Ensure();
  int hit = PyErr_CheckSignals() < 0;
  if (hit) { /* the engine reports its own error first; the interrupt follows it into Python */
    PyErr_Clear();
    PyErr_SetInterrupt();
  }
  PyGILState_Release(g);
  return hit;
}

static int nccl_init(PyObject* self, PyObject* args, PyObject* kwds) {
  nccl_object* o = (nccl_object*)self;
  static char* kwlist[] = {"gather_id", "reduce_id", "rank", "world", "device", "timeout", NULL};
  Py_buffer a, b;
  int rank, world, device;
  PyObject* timeout = Py_None;
  if (o->nccl) {
    PyErr_SetString(PyExc_RuntimeError, "NcclTransport is already initialised");
    return -1;
  }
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*y*iii|O:NcclTransport", kwlist, &a, &b, &rank, &world, &device,
                                   &timeout))
    return -1;
  int rc = -1;
  double seconds = timeout == Py_None ? 0.0 : PyFloat_AsDouble(timeout);
  if (PyErr_Occurred()) goto exit;
  if (a.len != (Py_ssize_t)sizeof(ncclUniqueId) || b.len != (Py_ssize_t)sizeof(ncclUniqueId)) {
    PyErr_Format(PyExc_ValueError, "NcclTransport: unique ids must be %zu bytes (from nccl_unique_id())",
                 sizeof(ncclUniqueId));
    goto exit;
  }
  ncclUniqueId ids[2];
  memcpy(&ids[0], a.buf, sizeof ids[0]);
  memcpy(&ids[1], b.buf, sizeof ids[1]);
  if (device < 0) {
    PyErr_Format(PyExc_ValueError, "NcclTransport: device must be a CUDA device index, not %d", device);
    goto exit;
  }
  mfsdp_status st;
  mfsdp_nccl* t = NULL;
  mfsdp_nccl_hooks hooks = {nccl_block_begin, nccl_block_end, nccl_interrupted, o};
  Py_BEGIN_ALLOW_THREADS /* communicator init waits for every rank */
  st = mfsdp_nccl_create(ids, rank, world, device, seconds, &hooks, &t);
  Py_END_ALLOW_THREADS
  if (st != MFSDP_OK) {
    mfsdp_raise(mfsdp_type_state(Py_TYPE(self)), st);
    goto exit;
  }
  o->nccl = t;
  o->head.ops = &mfsdp_nccl_ops;
  o->head.ctx = t;
  o->head.device = device;
  rc = 0;
exit:
  PyBuffer_Release(&a);
  PyBuffer_Release(&b);
  return rc;
}

static PyObject* nccl_failure(PyObject* self, void* closure) {
  (void)closure;
  nccl_object* o = (nccl_object*)self;
  const char* why = o->nccl ? mfsdp_nccl_failure(o->nccl) : NULL;
  if (why == NULL) Py_RETURN_NONE;
  return PyUnicode_FromString(why);
}

PyDoc_STRVAR(nccl_close_doc,
             "close()\n\n"
             "Collective: every rank calls it at the same point (after its last collective). Waits\n"
             "until every rank has closed (or the timeout), then finalizes and destroys the\n"
             "communicators. Raises if a peer never closes or the transport had failed; the\n"
             "communicators are aborted then. Closing twice is a no-op.");

static PyObject* nccl_close(PyObject* self, PyObject* unused) {
  (void)unused;
  nccl_object* o = (nccl_object*)self;
  if (o->nccl == NULL) Py_RETURN_NONE;
  mfsdp_status st;
  Py_BEGIN_ALLOW_THREADS /* waits for the peers */
  st = mfsdp_nccl_close(o->nccl);
  Py_END_ALLOW_THREADS
  if (st != MFSDP_OK) return mfsdp_raise(mfsdp_type_state(Py_TYPE(self)), st);
  Py_RETURN_NONE;
}

/* Garbage collection runs at different moments on different ranks: never wait for a peer here
 * (see [Note: closing] in csrc/cuda/nccl_transport.c). */
static void nccl_dealloc(PyObject* self) {
  PyTypeObject* tp = Py_TYPE(self);
  nccl_object* o = (nccl_object*)self;
  mfsdp_nccl* t = o->nccl;
  o->nccl = NULL;
  if (t) {
    Py_BEGIN_ALLOW_THREADS
    mfsdp_nccl_destroy(t);
    Py_END_ALLOW_THREADS
  }
  tp->tp_free(self);
  Py_DECREF(tp);
}

static PyMethodDef nccl_methods[] = {
    {"close", nccl_close, METH_NOARGS, nccl_close_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef nccl_getset[] = {
    {"failure", nccl_failure, NULL, "Why the transport stopped (timeout, NCCL error), or None.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot nccl_slots[] = {
    {Py_tp_doc, (void*)nccl_doc},
    {Py_tp_init, nccl_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, nccl_dealloc},
    {Py_tp_methods, nccl_methods},
    {Py_tp_getset, nccl_getset},
    {0, NULL},
};

static PyType_Spec nccl_spec = {
    .name = "megatron_fsdp_c._C.NcclTransport",
    .basicsize = sizeof(nccl_object),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = nccl_slots,
};

static PyObject* py_nccl_unique_id(PyObject* module, PyObject* unused) {
  (void)unused;
  ncclUniqueId id;
  ncclResult_t r;
  Py_BEGIN_ALLOW_THREADS
  r = ncclGetUniqueId(&id);
  Py_END_ALLOW_THREADS
  if (r != ncclSuccess) {
    mfsdp_set_error(MFSDP_ERR_NCCL, __FILE__, __LINE__, __func__, "ncclGetUniqueId: %s", ncclGetErrorString(r));
    return mfsdp_raise(mfsdp_module_state(module), MFSDP_ERR_NCCL);
  }
  return PyBytes_FromStringAndSize((const char*)&id, sizeof id);
}

/* (major, minor, patch) of a version code: NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since
 * 2.9 (X * 1000 + Y * 100 + Z before). */
static PyObject* version_tuple(int code) {
  if (code < 10000) return Py_BuildValue("(iii)", code / 1000, (code % 1000) / 100, code % 100);
  return Py_BuildValue("(iii)", code / 10000, (code % 10000) / 100, code % 100);
}

static PyObject* py_nccl_version(PyObject* module, PyObject* unused) {
  (void)unused;
  int code = 0;
  ncclResult_t r = ncclGetVersion(&code);
  if (r != ncclSuccess) {
    mfsdp_set_error(MFSDP_ERR_NCCL, __FILE__, __LINE__, __func__, "ncclGetVersion: %s", ncclGetErrorString(r));
    return mfsdp_raise(mfsdp_module_state(module), MFSDP_ERR_NCCL);
  }
  return version_tuple(code);
}

static PyMethodDef nccl_functions[] = {
    {"nccl_unique_id", py_nccl_unique_id, METH_NOARGS, "nccl_unique_id() -> bytes: a new NCCL unique id."},
    {"nccl_version", py_nccl_version, METH_NOARGS,
     "nccl_version() -> (major, minor, patch) of the libnccl this process loaded (ncclGetVersion)."},
    {NULL, NULL, 0, NULL},
};

int mfsdp_register_nccl_transport(PyObject* module, module_state* st) {
  st->nccl_transport_type = (PyTypeObject*)PyType_FromModuleAndSpec(module, &nccl_spec, NULL);
  if (st->nccl_transport_type == NULL || PyModule_AddType(module, st->nccl_transport_type) < 0) return -1;
  PyObject* built = version_tuple(NCCL_VERSION_CODE); /* the nccl.h this build compiled against */
  int rc = built ? PyModule_AddObjectRef(module, "NCCL_BUILD_VERSION", built) : -1;
  Py_XDECREF(built);
  if (rc < 0) return -1;
  return PyModule_AddFunctions(module, nccl_functions);
}

#else /* CPU-only build: no NCCL type or functions */

int mfsdp_register_nccl_transport(PyObject* module, module_state* st) {
  (void)module;
  st->nccl_transport_type = NULL;
  return 0;
}

#endif
