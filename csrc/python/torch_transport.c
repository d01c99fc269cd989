/* torch_transport.c: megatron_fsdp_c._C.TorchTransport, the torch.distributed transport.
 *
 * Collectives go through torch.distributed with async_op=True, called from C. Two process groups
 * over the same ranks, one for all-gathers and one for reductions, so a prefetching gather never
 * queues behind a gradient reduce-scatter on one communicator. A work handle is the torch Work
 * object itself. */
#include "pieces.h"

typedef struct torch_transport {
  transport_object head;
  PyObject* all_gather;     /* torch.distributed.all_gather_single (all_gather_into_tensor) */
  PyObject* reduce_scatter; /* torch.distributed.reduce_scatter_single (reduce_scatter_tensor) */
  PyObject* all_reduce;     /* torch.distributed.all_reduce */
  PyObject* all_to_all;     /* torch.distributed.all_to_all_single */
  PyObject* gather_group;
  PyObject* reduce_group;
  PyObject* ops[2];         /* ReduceOp.SUM, ReduceOp.AVG */
  PyObject* kw_gather;      /* ("group", "async_op") */
  PyObject* kw_reduce;      /* ("op", "group", "async_op") */
  PyObject* timeout;        /* datetime.timedelta for Work.wait, or NULL: the group's own timeout */
  int alias_safe;           /* reduce into a copy: see alias_safe_reduce_scatter */
} torch_transport;

static mfsdp_status issue(PyObject* fn, PyObject* const* args, size_t nargs, PyObject* kwnames, mfsdp_work** work,
                          const char* what) {
  PyObject* w = PyObject_Vectorcall(fn, args, nargs, kwnames);
  if (w == NULL) return mfsdp_status_from_python(MFSDP_ERR_COMM, what);
  *work = (mfsdp_work*)w; /* the Work object is the handle */
  return MFSDP_OK;
}

static mfsdp_status tt_all_gather(void* ctx, const mfsdp_buffer* full, const mfsdp_buffer* shard, mfsdp_work** work) {
  torch_transport* t = ctx;
  PyObject* args[] = {full->handle, shard->handle, t->gather_group, Py_True};
  return issue(t->all_gather, args, 2, t->kw_gather, work, "all_gather_into_tensor");
}

static mfsdp_status no_premul(double premul) {
  if (premul != 1.0) return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "the torch transport does not fuse a pre-multiplier");
  return MFSDP_OK;
}

/* torch's threaded test group (backend "threaded", FSDPTestMultiThread) reduces rank by rank
 * straight into each rank's output, so an output inside its own input (our rank's slice of the
 * full gradient bucket) is overwritten before that rank's contribution is read: the sum counts
 * some ranks twice. There the reduction goes into a copy, which that group has finished when the
 * call returns, and is copied back. Real backends reduce in place correctly and never get here. */
static mfsdp_status alias_safe_reduce_scatter(torch_transport* t, const mfsdp_buffer* shard,
                                              const mfsdp_buffer* full, mfsdp_reduce_op op, mfsdp_work** work) {
  PyObject* tmp = PyObject_CallMethod(shard->handle, "clone", NULL);
  if (tmp == NULL) return mfsdp_status_from_python(MFSDP_ERR_COMM, "reduce_scatter_tensor");
  PyObject* args[] = {tmp, full->handle, t->ops[op], t->reduce_group, Py_True};
  mfsdp_status st = issue(t->reduce_scatter, args, 2, t->kw_reduce, work, "reduce_scatter_tensor");
  PyObject* r = NULL;
  if (st == MFSDP_OK) {
    r = PyObject_CallMethod((PyObject*)*work, "wait", NULL);
    if (r != NULL) {
      Py_DECREF(r);
      r = PyObject_CallMethod(shard->handle, "copy_", "O", tmp);
    }
    if (r == NULL) {
      Py_CLEAR(*work);
      st = mfsdp_status_from_python(MFSDP_ERR_COMM, "reduce_scatter_tensor");
    }
    Py_XDECREF(r);
  }
  Py_DECREF(tmp);
  return st;
}

static mfsdp_status tt_reduce_scatter(void* ctx, const mfsdp_buffer* shard, const mfsdp_buffer* full,
                                     mfsdp_reduce_op op, double premul, mfsdp_work** work) {
  torch_transport* t = ctx;
  MFSDP_CHECK(no_premul(premul));
  if (t->alias_safe) return alias_safe_reduce_scatter(t, shard, full, op, work);
  PyObject* args[] = {shard->handle, full->handle, t->ops[op], t->reduce_group, Py_True};
  return issue(t->reduce_scatter, args, 2, t->kw_reduce, work, "reduce_scatter_tensor");
}

static mfsdp_status tt_all_reduce(void* ctx, const mfsdp_buffer* buf, mfsdp_reduce_op op, double premul,
                                  mfsdp_work** work) {
  torch_transport* t = ctx;
  MFSDP_CHECK(no_premul(premul));
  PyObject* args[] = {buf->handle, t->ops[op], t->reduce_group, Py_True};
  return issue(t->all_reduce, args, 1, t->kw_reduce, work, "all_reduce");
}

static mfsdp_status tt_all_to_all(void* ctx, const mfsdp_buffer* out, const mfsdp_buffer* in, mfsdp_work** work) {
  torch_transport* t = ctx;
  PyObject* args[] = {out->handle, in->handle, t->reduce_group, Py_True};
  return issue(t->all_to_all, args, 2, t->kw_gather, work, "all_to_all_single");
}

/* On CUDA, Work.wait() only orders the current stream after the collective; given a timeout,
 * ProcessGroupNCCL blocks the host until the collective ends, serialising CPU and GPU. There
 * the timeout belongs to the process groups (their watchdog), so wait() gets none. */
static mfsdp_status tt_wait(void* ctx, mfsdp_work* work) {
  torch_transport* t = ctx;
  PyObject* w = (PyObject*)work;
  if (w == NULL) return MFSDP_OK;
  PyObject* r = t->timeout && t->head.device < 0 ? PyObject_CallMethod(w, "wait", "O", t->timeout)
                                                 : PyObject_CallMethod(w, "wait", NULL);
  Py_DECREF(w);
  if (r == NULL) return mfsdp_status_from_python(MFSDP_ERR_COMM, "Work.wait");
  Py_DECREF(r);
  return MFSDP_OK;
}

static void tt_discard(void* ctx, mfsdp_work* work) {
  (void)ctx;
  Py_XDECREF((PyObject*)work);
}

static const mfsdp_transport_ops torch_transport_ops = {"torch",       tt_all_gather, tt_reduce_scatter,
                                                        tt_all_reduce, tt_all_to_all, tt_wait,
                                                        tt_discard,    NULL,          NULL,
                                                        0};

PyDoc_STRVAR(torch_transport_doc,
             "TorchTransport(all_gather_group, reduce_group, device=-1, timeout=None, alias_safe_reduce=False)\n\n"
             "Collectives through torch.distributed (any backend; gloo on CPU), called from C.\n"
             "all_gather_group and reduce_group are process groups over the same ranks. timeout: a\n"
             "datetime.timedelta after which waiting for a collective raises (None: the group's).\n"
             "Host buffers only (device -1): on CUDA Work.wait() gets no timeout, which would block\n"
             "the host; give the process groups the timeout instead. alias_safe_reduce: reduce-scatter\n"
             "into a copy (torch's threaded test group, which cannot reduce in place).");

/* torch >= 2.13 renamed the flat-tensor collectives; older releases only have the old names. */
static PyObject* attr_or_fallback(PyObject* module, const char* name, const char* fallback) {
  PyObject* fn = PyObject_GetAttrString(module, name);
  if (fn == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    fn = PyObject_GetAttrString(module, fallback);
  }
  return fn;
}

static int tt_init(PyObject* self, PyObject* args, PyObject* kwds) {
  torch_transport* t = (torch_transport*)self;
  static char* kwlist[] = {"all_gather_group", "reduce_group", "device", "timeout", "alias_safe_reduce", NULL};
  PyObject *ag, *rg, *timeout = Py_None;
  int device = -1, alias_safe = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|iOp:TorchTransport", kwlist, &ag, &rg, &device, &timeout,
                                   &alias_safe))
    return -1;
  t->alias_safe = alias_safe;
  Py_XSETREF(t->timeout, timeout == Py_None ? NULL : Py_NewRef(timeout));
  PyObject* dist = PyImport_ImportModule("torch.distributed");
  if (dist == NULL) return -1;
  PyObject* reduce_op = PyObject_GetAttrString(dist, "ReduceOp");
  int ok = reduce_op != NULL;
  if (ok) {
    Py_XSETREF(t->all_gather, attr_or_fallback(dist, "all_gather_single", "all_gather_into_tensor"));
    Py_XSETREF(t->reduce_scatter, attr_or_fallback(dist, "reduce_scatter_single", "reduce_scatter_tensor"));
    Py_XSETREF(t->all_reduce, PyObject_GetAttrString(dist, "all_reduce"));
    Py_XSETREF(t->all_to_all, PyObject_GetAttrString(dist, "all_to_all_single"));
    Py_XSETREF(t->ops[MFSDP_REDUCE_SUM], PyObject_GetAttrString(reduce_op, "SUM"));
    Py_XSETREF(t->ops[MFSDP_REDUCE_AVG], PyObject_GetAttrString(reduce_op, "AVG"));
    Py_XSETREF(t->kw_gather, Py_BuildValue("(ss)", "group", "async_op"));
    Py_XSETREF(t->kw_reduce, Py_BuildValue("(sss)", "op", "group", "async_op"));
    ok = t->all_gather && t->reduce_scatter && t->all_reduce && t->all_to_all && t->ops[0] && t->ops[1] && t->kw_gather &&
         t->kw_reduce;
  }
  Py_XDECREF(reduce_op);
  Py_DECREF(dist);
  if (!ok) return -1;
  Py_XSETREF(t->gather_group, Py_NewRef(ag));
  Py_XSETREF(t->reduce_group, Py_NewRef(rg));
  t->head.ops = &torch_transport_ops;
  t->head.ctx = t;
  t->head.device = device;
  return 0;
}

static int tt_traverse(PyObject* self, visitproc visit, void* arg) {
  torch_transport* t = (torch_transport*)self;
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(t->all_gather);
  Py_VISIT(t->reduce_scatter);
  Py_VISIT(t->all_reduce);
  Py_VISIT(t->all_to_all);
  Py_VISIT(t->gather_group);
  Py_VISIT(t->reduce_group);
  Py_VISIT(t->ops[0]);
  Py_VISIT(t->ops[1]);
  Py_VISIT(t->timeout);
  return 0;
}

static int tt_clear(PyObject* self) {
  torch_transport* t = (torch_transport*)self;
  Py_CLEAR(t->all_gather);
  Py_CLEAR(t->reduce_scatter);
  Py_CLEAR(t->all_reduce);
  Py_CLEAR(t->all_to_all);
  Py_CLEAR(t->gather_group);
  Py_CLEAR(t->reduce_group);
  Py_CLEAR(t->ops[0]);
  Py_CLEAR(t->ops[1]);
  Py_CLEAR(t->kw_gather);
  Py_CLEAR(t->kw_reduce);
  Py_CLEAR(t->timeout);
  return 0;
}

static void tt_dealloc(PyObject* self) {
  PyTypeObject* tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  tt_clear(self);
  tp->tp_free(self);
  Py_DECREF(tp);
}

static PyType_Slot tt_slots[] = {
    {Py_tp_doc, (void*)torch_transport_doc},
    {Py_tp_init, tt_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_traverse, tt_traverse},
    {Py_tp_clear, tt_clear},
    {Py_tp_dealloc, tt_dealloc},
    {0, NULL},
};

static PyType_Spec tt_spec = {
    .name = "megatron_fsdp_c._C.TorchTransport",
    .basicsize = sizeof(torch_transport),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = tt_slots,
};

int mfsdp_register_torch_transport(PyObject* module, module_state* st) {
  st->torch_transport_type = (PyTypeObject*)PyType_FromModuleAndSpec(module, &tt_spec, NULL);
  if (st->torch_transport_type == NULL) return -1;
  return PyModule_AddType(module, st->torch_transport_type);
}
