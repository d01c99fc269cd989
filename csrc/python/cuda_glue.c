/* cuda_glue.c: the CUDA half of megatron_fsdp_c._C: NcclTransport, NCCL unique ids, and the
 * CUDA kernels as functions on CUDA tensors (for tests and benchmarks). The C side lives in
 * csrc/cuda/, which includes no Python; a CPU-only build compiles only the no-op register
 * function at the end. */
#include "glue.h"

#ifdef MFSDP_WITH_CUDA
#include <time.h>

#include "../cuda/mfsdp_cuda.h"
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
 * csrc/cuda/nccl_transport.c): the GIL is released, if this thread holds it, and Ctrl-C is
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
    mfsdp_raise(mfsdp_state_of_type(Py_TYPE(self)), st);
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
  if (st != MFSDP_OK) return mfsdp_raise(mfsdp_state_of_type(Py_TYPE(self)), st);
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
    return mfsdp_raise((module_state*)PyModule_GetState(module), MFSDP_ERR_NCCL);
  }
  return PyBytes_FromStringAndSize((const char*)&id, sizeof id);
}

int mfsdp_use_current_stream(PyObject* current_stream, int device, void* kernels_ctx) {
  PyObject* stream = PyObject_CallFunction(current_stream, "i", device);
  PyObject* handle = stream ? PyObject_GetAttrString(stream, "cuda_stream") : NULL;
  Py_XDECREF(stream);
  if (handle == NULL) return -1;
  mfsdp_cuda_set_stream(kernels_ctx, (void*)(intptr_t)PyLong_AsLongLong(handle));
  Py_DECREF(handle);
  return PyErr_Occurred() ? -1 : 0;
}

/* Kernels on CUDA tensors, on torch's current stream: what the engine runs, for tests/benchmarks. */
static int current_stream_context(module_state* st, int device, void** ctx) {
  PyObject* cuda = PyObject_GetAttrString(st->torch, "cuda");
  PyObject* current_stream = cuda ? PyObject_GetAttrString(cuda, "current_stream") : NULL;
  Py_XDECREF(cuda);
  if (current_stream == NULL) return -1;
  mfsdp_status s = mfsdp_cuda_kernel_context(device, ctx);
  if (s != MFSDP_OK) {
    Py_DECREF(current_stream);
    mfsdp_raise(st, s);
    return -1;
  }
  int rc = mfsdp_use_current_stream(current_stream, device, *ctx);
  Py_DECREF(current_stream);
  return rc;
}

static int cuda_pair(PyObject* module, PyObject* dst, PyObject* src, tensor_view* d, tensor_view* s, void** ctx) {
  module_state* st = PyModule_GetState(module);
  if (mfsdp_tensor_view(st, dst, "cuda kernel", d) < 0 || mfsdp_tensor_view(st, src, "cuda kernel", s) < 0) return -1;
  if (d->device < 0 || d->device != s->device || d->numel != s->numel) {
    PyErr_SetString(PyExc_ValueError, "cuda kernel: both tensors must be on the same CUDA device, same size");
    return -1;
  }
  return current_stream_context(st, d->device, ctx);
}

/* cuda_pack_(dst, srcs, offsets, alpha=1.0, accumulate=False): the engine's one-launch gradient
 * pack: dst[offsets[i] : offsets[i] + srcs[i].numel()] = alpha * srcs[i] (or += ). */
static PyObject* py_cuda_pack(PyObject* module, PyObject* args) {
  PyObject *dst, *srcs, *offsets;
  double alpha = 1.0;
  int accumulate = 0;
  if (!PyArg_ParseTuple(args, "OOO|dp:cuda_pack_", &dst, &srcs, &offsets, &alpha, &accumulate)) return NULL;
  module_state* st = PyModule_GetState(module);
  tensor_view d;
  if (mfsdp_tensor_view(st, dst, "cuda_pack_ dst", &d) < 0) return NULL;
  PyObject* s_seq = PySequence_Fast(srcs, "cuda_pack_: srcs must be a sequence of tensors");
  PyObject* o_seq = s_seq ? PySequence_Fast(offsets, "cuda_pack_: offsets must be a sequence of ints") : NULL;
  mfsdp_pack_item* items = NULL;
  PyObject* result = NULL;
  if (o_seq == NULL) goto exit;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(s_seq);
  if (d.device < 0 || n != PySequence_Fast_GET_SIZE(o_seq) || n > INT32_MAX) {
    PyErr_SetString(PyExc_ValueError, "cuda_pack_: dst must be a CUDA tensor and srcs, offsets the same length");
    goto exit;
  }
  items = PyMem_Calloc((size_t)(n ? n : 1), sizeof *items);
  if (items == NULL) {
    PyErr_NoMemory();
    goto exit;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    tensor_view s;
    if (mfsdp_tensor_view(st, PySequence_Fast_GET_ITEM(s_seq, i), "cuda_pack_ src", &s) < 0) goto exit;
    long long off = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(o_seq, i));
    if (off == -1 && PyErr_Occurred()) goto exit;
    if (s.device != d.device || off < 0 || off + s.numel > d.numel) {
      PyErr_Format(PyExc_ValueError, "cuda_pack_: source %zd (%lld elements at offset %lld) is not on dst's device "
                   "or does not fit in dst (%lld elements)", i, (long long)s.numel, off, (long long)d.numel);
      goto exit;
    }
    items[i] = (mfsdp_pack_item){s.data, s.dtype, off, s.numel};
  }
  void* ctx;
  if (current_stream_context(st, d.device, &ctx) < 0) goto exit;
  mfsdp_status stt = mfsdp_cuda_kernels->pack(ctx, d.data, d.dtype, items, (int32_t)n, alpha, accumulate);
  if (stt != MFSDP_OK) {
    mfsdp_raise(st, stt);
    goto exit;
  }
  result = Py_None;
  Py_INCREF(result);
exit:
  PyMem_Free(items);
  Py_XDECREF(s_seq);
  Py_XDECREF(o_seq);
  return result;
}

static PyObject* py_cuda_copy(PyObject* module, PyObject* args) {
  PyObject *dst, *src;
  double alpha = 1.0;
  tensor_view d, s;
  void* ctx;
  if (!PyArg_ParseTuple(args, "OO|d:cuda_copy_", &dst, &src, &alpha) || cuda_pair(module, dst, src, &d, &s, &ctx) < 0)
    return NULL;
  mfsdp_status stt = mfsdp_cuda_copy(ctx, d.data, d.dtype, s.data, s.dtype, d.numel, alpha);
  if (stt != MFSDP_OK) return mfsdp_raise(PyModule_GetState(module), stt);
  Py_RETURN_NONE;
}

static PyObject* py_cuda_accumulate(PyObject* module, PyObject* args) {
  PyObject *dst, *src;
  double alpha = 1.0;
  tensor_view d, s;
  void* ctx;
  if (!PyArg_ParseTuple(args, "OO|d:cuda_accumulate_", &dst, &src, &alpha) ||
      cuda_pair(module, dst, src, &d, &s, &ctx) < 0)
    return NULL;
  mfsdp_status stt = mfsdp_cuda_accumulate(ctx, d.data, d.dtype, s.data, s.dtype, d.numel, alpha);
  if (stt != MFSDP_OK) return mfsdp_raise(PyModule_GetState(module), stt);
  Py_RETURN_NONE;
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
    return mfsdp_raise((module_state*)PyModule_GetState(module), MFSDP_ERR_NCCL);
  }
  return version_tuple(code);
}

static PyMethodDef cuda_methods[] = {
    {"nccl_unique_id", py_nccl_unique_id, METH_NOARGS, "nccl_unique_id() -> bytes: a new NCCL unique id."},
    {"nccl_version", py_nccl_version, METH_NOARGS,
     "nccl_version() -> (major, minor, patch) of the libnccl this process loaded (ncclGetVersion)."},
    {"cuda_copy_", py_cuda_copy, METH_VARARGS, "cuda_copy_(dst, src, alpha=1.0): the CUDA cast-copy kernel."},
    {"cuda_accumulate_", py_cuda_accumulate, METH_VARARGS,
     "cuda_accumulate_(dst, src, alpha=1.0): the CUDA accumulate kernel."},
    {"cuda_pack_", py_cuda_pack, METH_VARARGS,
     "cuda_pack_(dst, srcs, offsets, alpha=1.0, accumulate=False): the one-launch bucket pack."},
    {NULL, NULL, 0, NULL},
};

int mfsdp_register_nccl(PyObject* module, module_state* st) {
  st->nccl_transport_type = (PyTypeObject*)PyType_FromModuleAndSpec(module, &nccl_spec, NULL);
  if (st->nccl_transport_type == NULL || PyModule_AddType(module, st->nccl_transport_type) < 0) return -1;
  PyObject* built = version_tuple(NCCL_VERSION_CODE); /* the nccl.h this build compiled against */
  int rc = built ? PyModule_AddObjectRef(module, "NCCL_BUILD_VERSION", built) : -1;
  Py_XDECREF(built);
  if (rc < 0) return -1;
  return PyModule_AddFunctions(module, cuda_methods);
}

#else /* CPU-only build: no CUDA types or functions */

int mfsdp_register_nccl(PyObject* module, module_state* st) {
  (void)module;
  st->nccl_transport_type = NULL;
  return 0;
}

#endif
