/* engine.c: megatron_fsdp_c._C.Engine, the Python face of one mfsdp_pipeline.
 *
 * Ownership: the engine owns the pipeline, which owns every bucket buffer (torch tensors held
 * through the memory ops). It keeps a reference to its transport object for as long as the
 * pipeline may call it. Every method reaches the pipeline as [Note: engine calls] says. */
#include "bucket_spec.h"
#include "pieces.h"
#include "torch_memory.h"

#include "../cuda/mfsdp_cuda.h"

typedef struct engine_object {
  PyObject_HEAD
  mfsdp_pipeline* pipeline;
  torch_memory memory;
  torch_memory host_memory; /* offloaded buckets' host buffers, CUDA engines only ([Note: offloaded buckets]) */
  PyObject* transport;
  PyObject* outer_transport; /* hybrid sharding: the transport across replicas (NULL: none) */
  PyObject* device;
  PyObject* host_device;    /* torch.device('cpu'): host_memory's, CUDA engines only */
  PyObject* current_stream; /* torch.cuda.current_stream, CUDA engines only */
  void* kernels_ctx;
  int busy;                 /* a pipeline call is running ([Note: engine calls]) */
  int waiting;              /* wait_grads calls in flight, off the GIL (close refuses meanwhile) */
} engine_object;

static module_state* engine_state(PyObject* self) { return mfsdp_type_state(Py_TYPE(self)); }

static PyObject* fail(PyObject* self, mfsdp_status s) { return mfsdp_raise(engine_state(self), s); }

/* [Note: engine calls]
 * The pipeline is not re-entrant, and a call into it can run Python or let go of the GIL
 * midway: the memory ops and the torch transport call torch (Work.wait lets go of the GIL), the
 * native NCCL transport lets go of it while it waits for NCCL, and meanwhile another thread, a
 * signal handler or a profiler hook may call the engine. `busy` marks such a call. So:
 * - Every function that takes a non-const mfsdp_pipeline* runs through ENGINE_CALL: it checks
 *   that the engine is open and idle (ready), marks it busy, points the kernels at torch's
 *   current stream, runs the call and clears busy. It checks after the method has converted its
 *   arguments, right before the call, because converting them runs Python (__index__,
 *   __bool__, a tensor's methods) that may close the engine or start another call: checking
 *   first, as most methods once did, called a closed (NULL) pipeline. The rule goes by
 *   constness, not by what a mutation happens to call today: set_local, set_hold,
 *   set_outer_hold and set_prescale once checked busy without setting it.
 * - The const accessors (tensor, local_piece, weight_state, grad_state, stats) check ready
 *   after converting their arguments and do not mark busy: they run no Python and keep the GIL
 *   while they read, so no call can start meanwhile, and they leave the kernels' stream alone
 *   (it is shared with a call that may be waiting on another thread).
 * - The getters `broken` and `num_buckets` read one field and answer at any time, also while
 *   a call runs (a watchdog thread may poll `broken`) and after close().
 * - close() refuses while a call runs; the call still holds the pipeline. */

/* The engine is open and no call is running; else False with the exception set. */
static int ready(engine_object* e) {
  if (e->pipeline == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "Engine is not initialised or was closed");
    return 0;
  }
  if (e->busy) {
    PyErr_SetString(PyExc_RuntimeError, "Engine re-entered from another thread or a callback; calls must not overlap");
    return 0;
  }
  return 1;
}

/* CUDA engines launch on torch's current stream: read it at every call (cheap, and it may
 * change between calls under torch.cuda.stream(...)). */
static int refresh_stream(engine_object* e) {
#ifdef MFSDP_WITH_CUDA
  return e->current_stream == NULL ||
         mfsdp_use_current_stream(e->current_stream, e->memory.device_index, e->kernels_ctx) == 0;
#else
  (void)e;
  return 1;
#endif
}

static int engine_enter(engine_object* e) {
  if (!ready(e)) return 0;
  e->busy = 1; /* before the stream is read: that calls torch */
  if (refresh_stream(e)) return 1;
  e->busy = 0;
  return 0;
}

static mfsdp_status engine_leave(engine_object* e, mfsdp_status s) {
  e->busy = 0;
  return s;
}

/* The status of `call`, a pipeline function on e->pipeline, run as [Note: engine calls] says;
 * MFSDP_ERR_PYTHON with the exception set when the engine cannot take a call (fail() keeps it).
 * `call` is evaluated only after the engine was entered. */
#define ENGINE_CALL(e, call) (engine_enter(e) ? engine_leave((e), (call)) : MFSDP_ERR_PYTHON)

/* A method's one argument as a bucket id of a ready engine; -1 with the Python error set. */
static long bucket_arg(engine_object* e, PyObject* arg) {
  long b = PyLong_AsLong(arg);
  if (PyErr_Occurred() || !ready(e)) return -1;
  if (b < 0 || b >= mfsdp_pipeline_num_buckets(e->pipeline)) {
    PyErr_Format(PyExc_IndexError, "bucket %ld", b);
    return -1;
  }
  return b;
}

static PyObject* none_or_fail(PyObject* self, mfsdp_status s) {
  return s == MFSDP_OK ? Py_NewRef(Py_None) : fail(self, s);
}

/* ------------------------------------------------------------------------------------------ */
/* construction */

PyDoc_STRVAR(engine_doc,
             "Engine(buckets, dp_world, dp_rank, grad_prescale, reduce_op, reduce_queue_bytes, device, transport,\n"
             "       force_comm=False, outer_transport=None, outer_world=1, outer_sharded=False, pin_host=False)\n\n"
             "One collective pipeline over the given bucket specs (see csrc/comm/mfsdp_pipeline.h).\n"
             "reduce_op: 'sum' or 'avg'. device: torch.device of every buffer. transport: a\n"
             "TorchTransport or NcclTransport over the data-parallel ranks (of one replica). force_comm:\n"
             "collectives even on one rank (single_rank_collectives: a transport tested on one GPU).\n"
             "outer_transport, outer_world: hybrid sharding, the replicas across which reduced gradients\n"
             "are also all-reduced ([Note: hybrid sharding] in csrc/comm/replicas.c). outer_sharded:\n"
             "HFSDP, sharded buckets also split over the replicas ([Note: optimizer sharded across\n"
             "replicas]): their specs have dp_world * outer_world shards. pin_host: on a CUDA device,\n"
             "offloaded buckets' host buffers are pinned ([Note: offloaded buckets] in\n"
             "csrc/comm/buffers.c; on the CPU every buffer is host memory already).");

static int engine_init(PyObject* self, PyObject* args, PyObject* kwds) {
  engine_object* e = (engine_object*)self;
  module_state* st = engine_state(self);
  static char* kwlist[] = {"buckets", "dp_world",  "dp_rank",    "grad_prescale",   "reduce_op",   "reduce_queue_bytes",
                           "device",  "transport", "force_comm", "outer_transport", "outer_world", "outer_sharded",
                           "pin_host", NULL};
  PyObject *specs_obj, *device, *transport, *outer = Py_None;
  int dp_world, dp_rank, force_comm = 0, outer_world = 1, outer_sharded = 0, pin_host = 0;
  double prescale;
  const char* op;
  long long queue_bytes;
  if (e->pipeline != NULL) {
    PyErr_SetString(PyExc_RuntimeError, "Engine is already initialised");
    return -1;
  }
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OiidsLOO|pOipp:Engine", kwlist, &specs_obj, &dp_world, &dp_rank,
                                   &prescale, &op, &queue_bytes, &device, &transport, &force_comm, &outer,
                                   &outer_world, &outer_sharded, &pin_host))
    return -1;
  for (int k = 0; k < 2; ++k) {
    PyObject* t = k == 0 ? transport : outer;
    if (k == 1 && t == Py_None) break;
    if (!PyObject_TypeCheck(t, st->torch_transport_type) &&
        !(st->nccl_transport_type && PyObject_TypeCheck(t, st->nccl_transport_type))) {
      PyErr_Format(PyExc_TypeError, "Engine: %s must be a TorchTransport or NcclTransport, got %.100s",
                   k == 0 ? "transport" : "outer_transport", Py_TYPE(t)->tp_name);
      return -1;
    }
  }
  if (outer_world > 1 && outer == Py_None) {
    PyErr_Format(PyExc_ValueError, "Engine: %d replicas need an outer_transport", outer_world);
    return -1;
  }
  int reduce_op = strcmp(op, "sum") == 0 ? MFSDP_REDUCE_SUM : strcmp(op, "avg") == 0 ? MFSDP_REDUCE_AVG : -1;
  if (reduce_op < 0) {
    PyErr_Format(PyExc_ValueError, "Engine: reduce_op must be 'sum' or 'avg', not '%s'", op);
    return -1;
  }
  torch_memory memory;
  if (mfsdp_torch_memory_init(&memory, st, device) < 0) return -1;
  int is_cuda = memory.device_index >= 0, device_index = memory.device_index;

  const mfsdp_kernel_ops* kernels = &mfsdp_cpu_kernels;
  void* kernels_ctx = NULL;
  if (is_cuda) {
    if (mfsdp_cuda_kernels == NULL) {
      PyErr_SetString(PyExc_RuntimeError,
                      "Engine: CUDA device requested but megatron_fsdp_c was built without CUDA "
                      "(rebuild on a machine with nvcc: pip install -e . --no-build-isolation)");
      return -1;
    }
    kernels = mfsdp_cuda_kernels;
    mfsdp_status s = mfsdp_cuda_kernel_context(device_index, &kernels_ctx);
    if (s != MFSDP_OK) {
      fail(self, s);
      return -1;
    }
    PyObject* cuda = PyObject_GetAttrString(st->torch, "cuda");
    Py_XSETREF(e->current_stream, cuda ? PyObject_GetAttrString(cuda, "current_stream") : NULL);
    Py_XDECREF(cuda);
    if (e->current_stream == NULL) return -1;
    PyObject* cpu = PyObject_CallMethod(st->torch, "device", "s", "cpu");
    if (cpu == NULL) return -1;
    Py_XSETREF(e->host_device, cpu);
    mfsdp_torch_host_memory_init(&e->host_memory, st, e->host_device, pin_host);
  }
  e->kernels_ctx = kernels_ctx;

  mfsdp_bucket_spec* specs;
  int32_t n;
  if (mfsdp_bucket_specs_from_python(specs_obj, &specs, &n) < 0) return -1;

  Py_XSETREF(e->device, Py_NewRef(device));
  Py_XSETREF(e->transport, Py_NewRef(transport));
  Py_XSETREF(e->outer_transport, outer == Py_None ? NULL : Py_NewRef(outer));
  e->memory = memory; /* its device: e->device, the same object */
  transport_object* t = (transport_object*)transport;
  transport_object* o = (transport_object*)e->outer_transport;
  mfsdp_backend be = {&mfsdp_torch_memory_ops, &e->memory, t->ops, t->ctx, kernels, kernels_ctx,
                      o ? o->ops : NULL, o ? o->ctx : NULL,
                      is_cuda ? &mfsdp_torch_memory_ops : NULL, is_cuda ? &e->host_memory : NULL};
  mfsdp_pipeline_config cfg = {dp_world, dp_rank, prescale, reduce_op, queue_bytes, force_comm, outer_world, outer_sharded};
  mfsdp_status s = mfsdp_pipeline_create(&cfg, &be, specs, n, &e->pipeline);
  mfsdp_free_bucket_specs(specs, n); /* the pipeline keeps copies */
  if (s != MFSDP_OK) {
    fail(self, s);
    return -1;
  }
  return 0;
}

static void engine_close_pipeline(engine_object* e) {
  mfsdp_pipeline* p = e->pipeline;
  e->pipeline = NULL;
  if (p) mfsdp_pipeline_destroy(p);
}

static int engine_traverse(PyObject* self, visitproc visit, void* arg) {
  engine_object* e = (engine_object*)self;
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(e->transport);
  Py_VISIT(e->outer_transport);
  Py_VISIT(e->device);
  Py_VISIT(e->host_device);
  Py_VISIT(e->current_stream);
  return 0;
}

static int engine_clear(PyObject* self) {
  engine_object* e = (engine_object*)self;
  engine_close_pipeline(e);
  Py_CLEAR(e->transport);
  Py_CLEAR(e->outer_transport);
  Py_CLEAR(e->device);
  Py_CLEAR(e->host_device);
  Py_CLEAR(e->current_stream);
  return 0;
}

static void engine_dealloc(PyObject* self) {
  PyTypeObject* tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  engine_clear(self);
  tp->tp_free(self);
  Py_DECREF(tp);
}

/* ------------------------------------------------------------------------------------------ */
/* methods ([Note: engine calls]) */

#define MAX_IDS_ON_STACK 64

/* Reads a sequence of ints (bucket or item ids) into `stack`, or a heap array when longer than
 * MAX_IDS_ON_STACK; *out points at them. Free with release_ids. 0 on success. */
static int read_ids(PyObject* ids, int32_t* stack, int32_t** out, int32_t* n) {
  PyObject* fast = PySequence_Fast(ids, "ids must be a sequence of ints");
  if (fast == NULL) return -1;
  Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
  int32_t* arr = len <= MAX_IDS_ON_STACK ? stack : PyMem_Malloc((size_t)len * sizeof *arr);
  int rc = -1;
  if (arr == NULL) {
    PyErr_NoMemory();
    goto exit;
  }
  for (Py_ssize_t i = 0; i < len; ++i) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == -1 && PyErr_Occurred()) goto exit;
    arr[i] = (int32_t)v;
  }
  rc = 0;
exit:
  if (rc != 0 && arr != stack) PyMem_Free(arr);
  Py_DECREF(fast);
  *out = rc == 0 ? arr : NULL;
  *n = (int32_t)len;
  return rc;
}

static void release_ids(int32_t* arr, int32_t* stack) {
  if (arr != stack) PyMem_Free(arr);
}

/* Runs a pipeline call over a sequence of bucket ids. */
static PyObject* over_ids(PyObject* self, PyObject* ids,
                          mfsdp_status (*fn)(mfsdp_pipeline*, const int32_t*, int32_t)) {
  engine_object* e = (engine_object*)self;
  int32_t stack[MAX_IDS_ON_STACK], *arr, n;
  if (read_ids(ids, stack, &arr, &n) < 0) return NULL;
  mfsdp_status s = ENGINE_CALL(e, fn(e->pipeline, arr, n));
  release_ids(arr, stack);
  return none_or_fail(self, s);
}

static PyObject* engine_unshard(PyObject* self, PyObject* ids) { return over_ids(self, ids, mfsdp_pipeline_unshard); }
static PyObject* engine_wait_unshard(PyObject* self, PyObject* ids) {
  return over_ids(self, ids, mfsdp_pipeline_wait_unshard);
}
static PyObject* engine_reshard(PyObject* self, PyObject* ids) { return over_ids(self, ids, mfsdp_pipeline_reshard); }
static PyObject* engine_seal(PyObject* self, PyObject* ids) { return over_ids(self, ids, mfsdp_pipeline_seal); }
static PyObject* engine_set_reduce_order(PyObject* self, PyObject* ids) {
  return over_ids(self, ids, mfsdp_pipeline_set_reduce_order);
}

static PyObject* run(PyObject* self, mfsdp_status (*fn)(mfsdp_pipeline*)) {
  engine_object* e = (engine_object*)self;
  return none_or_fail(self, ENGINE_CALL(e, fn(e->pipeline)));
}

static PyObject* engine_end_backward(PyObject* self, PyObject* unused) {
  (void)unused;
  return run(self, mfsdp_pipeline_end_backward);
}
static PyObject* engine_sync_grads(PyObject* self, PyObject* unused) {
  (void)unused;
  return run(self, mfsdp_pipeline_sync_grads);
}
static PyObject* engine_zero_grads(PyObject* self, PyObject* unused) {
  (void)unused;
  return run(self, mfsdp_pipeline_zero_grads);
}
static PyObject* engine_drain(PyObject* self, PyObject* unused) {
  (void)unused;
  return run(self, mfsdp_pipeline_drain);
}

static PyObject* engine_begin_backward(PyObject* self, PyObject* sync) {
  engine_object* e = (engine_object*)self;
  int flag = PyObject_IsTrue(sync);
  if (flag < 0) return NULL;
  return none_or_fail(self, ENGINE_CALL(e, mfsdp_pipeline_begin_backward(e->pipeline, flag)));
}

static PyObject* engine_install_main_weights(PyObject* self, PyObject* args) {
  engine_object* e = (engine_object*)self;
  int include_frozen = 0;
  if (!PyArg_ParseTuple(args, "|p:install_main_weights", &include_frozen)) return NULL;
  return none_or_fail(self, ENGINE_CALL(e, mfsdp_pipeline_install_main_weights(e->pipeline, include_frozen)));
}

/* A parameter or gradient tensor given to (bucket, item): its view, on the engine's device. An
 * engine without a pipeline has no device yet (ENGINE_CALL refuses it next). */
static int item_tensor(PyObject* self, PyObject* const* args, Py_ssize_t nargs, const char* what, const char* usage,
                       long* b, long* i, tensor_view* v) {
  engine_object* e = (engine_object*)self;
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "%s takes 3 arguments", usage);
    return -1;
  }
  *b = PyLong_AsLong(args[0]);
  *i = PyLong_AsLong(args[1]);
  if (PyErr_Occurred() || mfsdp_tensor_view(engine_state(self), args[2], what, v) < 0) return -1;
  if (e->pipeline != NULL && v->device != e->memory.device_index) {
    PyErr_Format(PyExc_ValueError, "%s: tensor is on %s%d but the engine's buffers are on %s%d", what,
                 v->device < 0 ? "cpu" : "cuda:", v->device < 0 ? 0 : v->device,
                 e->memory.device_index < 0 ? "cpu" : "cuda:", e->memory.device_index < 0 ? 0 : e->memory.device_index);
    return -1;
  }
  return 0;
}

static PyObject* engine_grad_ready(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  engine_object* e = (engine_object*)self;
  long b, i;
  tensor_view v;
  if (item_tensor(self, args, nargs, "grad_ready", "grad_ready(bucket, item, grad)", &b, &i, &v) < 0) return NULL;
  return none_or_fail(self, ENGINE_CALL(e, mfsdp_pipeline_grad_ready(e->pipeline, (int32_t)b, (int32_t)i, v.data,
                                                                     v.dtype, v.numel, args[2])));
}

static PyObject* engine_set_item(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  engine_object* e = (engine_object*)self;
  long b, i;
  tensor_view v;
  if (item_tensor(self, args, nargs, "set_item", "set_item(bucket, item, tensor)", &b, &i, &v) < 0) return NULL;
  return none_or_fail(
      self, ENGINE_CALL(e, mfsdp_pipeline_set_item(e->pipeline, (int32_t)b, (int32_t)i, v.data, v.dtype, v.numel)));
}

static PyObject* engine_set_local(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  engine_object* e = (engine_object*)self;
  long b, i;
  tensor_view v;
  if (item_tensor(self, args, nargs, "set_local", "set_local(bucket, item, tensor)", &b, &i, &v) < 0) return NULL;
  return none_or_fail(
      self, ENGINE_CALL(e, mfsdp_pipeline_set_local(e->pipeline, (int32_t)b, (int32_t)i, v.data, v.dtype, v.numel)));
}

static PyObject* engine_init_begin(PyObject* self, PyObject* args) {
  engine_object* e = (engine_object*)self;
  int b, direct = 0;
  if (!PyArg_ParseTuple(args, "i|p:init_begin", &b, &direct)) return NULL;
  return none_or_fail(self, ENGINE_CALL(e, mfsdp_pipeline_init_begin(e->pipeline, (int32_t)b, direct)));
}

static PyObject* engine_init_end(PyObject* self, PyObject* arg) {
  engine_object* e = (engine_object*)self;
  long b = PyLong_AsLong(arg);
  if (PyErr_Occurred()) return NULL;
  return none_or_fail(self, ENGINE_CALL(e, mfsdp_pipeline_init_end(e->pipeline, (int32_t)b)));
}

static PyObject* engine_set_comm_dtype(PyObject* self, PyObject* arg) {
  engine_object* e = (engine_object*)self;
  int code = -1;
  if (arg != Py_None && (code = mfsdp_dtype_code(engine_state(self), arg, "set_comm_dtype")) < 0) return NULL;
  return none_or_fail(self, ENGINE_CALL(e, mfsdp_pipeline_set_comm_dtype(e->pipeline, code)));
}

static PyObject* engine_zero_item_grads(PyObject* self, PyObject* args) {
  engine_object* e = (engine_object*)self;
  int b;
  PyObject* items;
  int32_t stack[MAX_IDS_ON_STACK], *arr, n;
  if (!PyArg_ParseTuple(args, "iO:zero_item_grads", &b, &items) || read_ids(items, stack, &arr, &n) < 0) return NULL;
  mfsdp_status s = ENGINE_CALL(e, mfsdp_pipeline_zero_item_grads(e->pipeline, b, arr, n));
  release_ids(arr, stack);
  return none_or_fail(self, s);
}

/* set_hold, set_outer_hold and set_keep_weights: (buckets, flag). */
static PyObject* hold_ids(PyObject* self, PyObject* args, const char* format,
                          mfsdp_status (*fn)(mfsdp_pipeline*, const int32_t*, int32_t, int)) {
  engine_object* e = (engine_object*)self;
  PyObject* ids;
  int hold;
  int32_t stack[MAX_IDS_ON_STACK], *arr, n;
  if (!PyArg_ParseTuple(args, format, &ids, &hold) || read_ids(ids, stack, &arr, &n) < 0) return NULL;
  mfsdp_status s = ENGINE_CALL(e, fn(e->pipeline, arr, n, hold));
  release_ids(arr, stack);
  return none_or_fail(self, s);
}

static PyObject* engine_set_hold(PyObject* self, PyObject* args) {
  return hold_ids(self, args, "Op:set_hold", mfsdp_pipeline_set_hold);
}

static PyObject* engine_set_outer_hold(PyObject* self, PyObject* args) {
  return hold_ids(self, args, "Op:set_outer_hold", mfsdp_pipeline_set_outer_hold);
}

static PyObject* engine_set_keep_weights(PyObject* self, PyObject* args) {
  return hold_ids(self, args, "Op:set_keep_weights", mfsdp_pipeline_set_keep_weights);
}

static PyObject* engine_set_prescale(PyObject* self, PyObject* args) {
  engine_object* e = (engine_object*)self;
  PyObject* ids;
  double prescale;
  int32_t stack[MAX_IDS_ON_STACK], *arr, n;
  if (!PyArg_ParseTuple(args, "Od:set_prescale", &ids, &prescale) || read_ids(ids, stack, &arr, &n) < 0) return NULL;
  mfsdp_status s = ENGINE_CALL(e, mfsdp_pipeline_set_prescale(e->pipeline, arr, n, prescale));
  release_ids(arr, stack);
  return none_or_fail(self, s);
}

static PyObject* engine_set_trainable(PyObject* self, PyObject* args) {
  engine_object* e = (engine_object*)self;
  int b, trainable;
  PyObject* items;
  int32_t stack[MAX_IDS_ON_STACK], *arr, n;
  if (!PyArg_ParseTuple(args, "iOp:set_trainable", &b, &items, &trainable) || read_ids(items, stack, &arr, &n) < 0)
    return NULL;
  mfsdp_status s = ENGINE_CALL(e, mfsdp_pipeline_set_trainable(e->pipeline, b, arr, n, trainable));
  release_ids(arr, stack);
  return none_or_fail(self, s);
}

static PyObject* engine_release_grads(PyObject* self, PyObject* ids) {
  return over_ids(self, ids, mfsdp_pipeline_release_grads);
}

/* const accessors (tensor ... stats): ready() after the arguments, no busy ([Note: engine calls]) */

static PyObject* engine_tensor(PyObject* self, PyObject* args) {
  engine_object* e = (engine_object*)self;
  int b, kind;
  if (!PyArg_ParseTuple(args, "ii:tensor", &b, &kind) || !ready(e)) return NULL;
  if (b < 0 || b >= mfsdp_pipeline_num_buckets(e->pipeline) || kind < 0 || kind >= MFSDP_BUF_COUNT)
    return PyErr_Format(PyExc_IndexError, "tensor(%d, %d): no such bucket or buffer kind", b, kind);
  const mfsdp_buffer* buf = mfsdp_pipeline_buffer(e->pipeline, b, kind);
  if (buf == NULL) Py_RETURN_NONE;
  return Py_NewRef((PyObject*)buf->handle);
}

static PyObject* engine_local_piece(PyObject* self, PyObject* args) {
  engine_object* e = (engine_object*)self;
  int b, i, kind;
  if (!PyArg_ParseTuple(args, "iii:local_piece", &b, &i, &kind) || !ready(e)) return NULL;
  int32_t where;
  int64_t offset, n;
  mfsdp_status s = mfsdp_pipeline_local_piece(e->pipeline, b, i, kind, &where, &offset, &n);
  if (s != MFSDP_OK) return fail(self, s);
  return Py_BuildValue("(iLL)", (int)where, (long long)offset, (long long)n);
}

static PyObject* engine_weight_state(PyObject* self, PyObject* arg) {
  engine_object* e = (engine_object*)self;
  long b = bucket_arg(e, arg);
  if (b < 0) return NULL;
  static const char* names[] = {"empty", "gathering", "ready", "stale"};
  return PyUnicode_FromString(names[mfsdp_pipeline_weight_state(e->pipeline, (int32_t)b)]);
}

static PyObject* engine_grad_state(PyObject* self, PyObject* arg) {
  engine_object* e = (engine_object*)self;
  long b = bucket_arg(e, arg);
  if (b < 0) return NULL;
  static const char* names[] = {"clean", "dirty", "reducing", "reduced"};
  return PyUnicode_FromString(names[mfsdp_pipeline_grad_state(e->pipeline, (int32_t)b)]);
}

static PyObject* engine_read_flags(PyObject* self, PyObject* arg) {
  engine_object* e = (engine_object*)self;
  long b = bucket_arg(e, arg);
  if (b < 0) return NULL;
  int64_t offset = 0;
  int32_t n = 0, every_rank = 1;
  mfsdp_status st = mfsdp_pipeline_flag_tail(e->pipeline, (int32_t)b, &offset, &n, &every_rank);
  if (st != MFSDP_OK) return fail(self, st);
  if (n == 0) Py_RETURN_NONE;
  /* filled before anyone else sees them */
  PyObject* used = PyBytes_FromStringAndSize(NULL, n);
  PyObject* split = used ? PyBytes_FromStringAndSize(NULL, n) : NULL;
  if (split) {
    st = ENGINE_CALL(e, mfsdp_pipeline_read_flags(e->pipeline, (int32_t)b, (uint8_t*)PyBytes_AS_STRING(used),
                                                  (uint8_t*)PyBytes_AS_STRING(split), &n));
    if (st == MFSDP_OK) return Py_BuildValue("(NN)", used, split);
    fail(self, st);
  }
  Py_XDECREF(used);
  Py_XDECREF(split);
  return NULL;
}

static PyObject* engine_finish_grads(PyObject* self, PyObject* arg) {
  engine_object* e = (engine_object*)self;
  long b = bucket_arg(e, arg);
  if (b < 0) return NULL;
  int done = 0;
  mfsdp_status st = ENGINE_CALL(e, mfsdp_pipeline_finish_grads(e->pipeline, (int32_t)b, &done));
  return st == MFSDP_OK ? PyBool_FromLong(done) : fail(self, st);
}

/* Not an ENGINE_CALL: it runs on the optimizer's worker thread beside the autograd thread's calls
 * (which may be inside the engine, off the GIL), and touches only bucket b's mark
 * (mfsdp_pipeline_wait_grads); the GIL is let go while the host waits. */
static PyObject* engine_wait_grads(PyObject* self, PyObject* arg) {
  engine_object* e = (engine_object*)self;
  long b = PyLong_AsLong(arg);
  if (PyErr_Occurred()) return NULL;
  if (e->pipeline == NULL) return PyErr_Format(PyExc_RuntimeError, "Engine is not initialised or was closed");
  if (b < 0 || b >= mfsdp_pipeline_num_buckets(e->pipeline)) return PyErr_Format(PyExc_IndexError, "bucket %ld", b);
  mfsdp_pipeline* p = e->pipeline;
  mfsdp_status st;
  e->waiting++;
  Py_BEGIN_ALLOW_THREADS
  st = mfsdp_pipeline_wait_grads(p, (int32_t)b);
  Py_END_ALLOW_THREADS
  e->waiting--;
  return none_or_fail(self, st);
}

static PyObject* engine_stats(PyObject* self, PyObject* args) {
  engine_object* e = (engine_object*)self;
  int b = -1;
  if (!PyArg_ParseTuple(args, "|i:stats", &b) || !ready(e)) return NULL;
  if (b < -1 || b >= mfsdp_pipeline_num_buckets(e->pipeline)) return PyErr_Format(PyExc_IndexError, "bucket %d", b);
  mfsdp_comm_stats s;
  mfsdp_pipeline_stats(e->pipeline, b, &s);
  /* every counter of MFSDP_COMM_COUNTERS, in its order: "<kind>s" and "<kind>_bytes" */
#define STAT_KEYS_(kind) #kind "s", #kind "_bytes",
#define STAT_VALUES_(kind) s.kind##s, s.kind##_bytes,
  static const char* const keys[] = {MFSDP_COMM_COUNTERS(STAT_KEYS_)};
  const int64_t values[] = {MFSDP_COMM_COUNTERS(STAT_VALUES_)};
#undef STAT_KEYS_
#undef STAT_VALUES_
  PyObject* dict = PyDict_New();
  for (size_t i = 0; dict != NULL && i < sizeof keys / sizeof *keys; ++i) {
    PyObject* value = PyLong_FromLongLong((long long)values[i]);
    if (value == NULL || PyDict_SetItemString(dict, keys[i], value) < 0) Py_CLEAR(dict);
    Py_XDECREF(value);
  }
  return dict;
}

static PyObject* engine_count_nonfinite_grad(PyObject* self, PyObject* args) {
  engine_object* e = (engine_object*)self;
  int b, i;
  int64_t count = 0;
  if (!PyArg_ParseTuple(args, "ii:count_nonfinite_grad", &b, &i)) return NULL;
  mfsdp_status s = ENGINE_CALL(e, mfsdp_pipeline_count_nonfinite_grad(e->pipeline, b, i, &count));
  if (s != MFSDP_OK) return fail(self, s);
  return PyLong_FromLongLong(count);
}

static PyObject* engine_broken(PyObject* self, void* closure) {
  (void)closure;
  engine_object* e = (engine_object*)self;
  if (e->pipeline == NULL) Py_RETURN_NONE;
  const char* text = mfsdp_pipeline_broken(e->pipeline);
  if (!text[0]) Py_RETURN_NONE;
  return PyUnicode_FromString(text);
}

static PyObject* engine_num_buckets(PyObject* self, void* closure) {
  (void)closure;
  engine_object* e = (engine_object*)self;
  return PyLong_FromLong(e->pipeline ? mfsdp_pipeline_num_buckets(e->pipeline) : 0);
}

static PyObject* engine_close(PyObject* self, PyObject* unused) {
  (void)unused;
  engine_object* e = (engine_object*)self;
  if (e->busy) { /* another thread is inside a call (the NCCL transport lets go of the GIL while it waits) */
    PyErr_SetString(PyExc_RuntimeError, "Engine.close() while another call is running");
    return NULL;
  }
  if (e->waiting) { /* an optimizer's worker waits for a bucket's gradients (wait_grads) */
    PyErr_SetString(PyExc_RuntimeError, "Engine.close() while an optimizer step waits for gradients: join it first");
    return NULL;
  }
  engine_close_pipeline(e);
  Py_RETURN_NONE;
}

static PyMethodDef engine_methods[] = {
    {"init_begin", engine_init_begin, METH_VARARGS,
     "init_begin(bucket, direct=False): start loading parameters (direct: write only this rank's rows)."},
    {"set_item", (PyCFunction)(void (*)(void))engine_set_item, METH_FASTCALL,
     "set_item(bucket, item, tensor): copy a parameter's values into the bucket."},
    {"set_local", (PyCFunction)(void (*)(void))engine_set_local, METH_FASTCALL,
     "set_local(bucket, item, tensor): this rank's rows of a parameter (direct initialisation)."},
    {"init_end", engine_init_end, METH_O, "init_end(bucket): derive shard and main weights, release temporaries."},
    {"set_hold", engine_set_hold, METH_VARARGS,
     "set_hold(buckets, hold): ZeRO-2/3 buckets on hold accumulate local gradients and do not reduce."},
    {"set_outer_hold", engine_set_outer_hold, METH_VARARGS,
     "set_outer_hold(buckets, hold): skip the all-reduce across replicas (hybrid sharding) for these buckets."},
    {"set_prescale", engine_set_prescale, METH_VARARGS,
     "set_prescale(buckets, factor): gradients of these buckets are multiplied by factor before the sum."},
    {"set_trainable", engine_set_trainable, METH_VARARGS,
     "set_trainable(bucket, items, trainable): which items train (the first creates the bucket's gradient buffers)."},
    {"release_grads", engine_release_grads, METH_O,
     "release_grads(buckets): free the gradient buffers of buckets none of whose items trains."},
    {"unshard", engine_unshard, METH_O, "unshard(buckets): start all-gathers of the full weights."},
    {"wait_unshard", engine_wait_unshard, METH_O, "wait_unshard(buckets): full weights usable after this."},
    {"reshard", engine_reshard, METH_O, "reshard(buckets): release the full weights of the ZeRO-3 buckets among them (kept stale under "
     "set_keep_weights); others are left as they are."},
    {"set_keep_weights", engine_set_keep_weights, METH_VARARGS,
     "set_keep_weights(buckets, keep): ZeRO-3 buckets keep their full weights' memory when resharded (stale)."},
    {"install_main_weights", engine_install_main_weights, METH_VARARGS,
     "install_main_weights(include_frozen=False): main -> compute weights; full weights become stale."},
    {"begin_backward", engine_begin_backward, METH_O, "begin_backward(sync): a backward pass starts."},
    {"grad_ready", (PyCFunction)(void (*)(void))engine_grad_ready, METH_FASTCALL,
     "grad_ready(bucket, item, grad): one parameter's gradient of this backward."},
    {"seal", engine_seal, METH_O,
     "seal(buckets): these buckets get no more gradients in this backward (their unit did not run here)."},
    {"end_backward", engine_end_backward, METH_NOARGS, "end_backward(): flush and finish this backward's reductions."},
    {"set_reduce_order", engine_set_reduce_order, METH_O,
     "set_reduce_order(buckets): the order every rank launches gradient reductions in (a permutation)."},
    {"sync_grads", engine_sync_grads, METH_NOARGS,
     "sync_grads(): reduce pending no_shard/ZeRO-1 gradients once, finish all reductions, fill OPT_GRAD."},
    {"finish_grads", engine_finish_grads, METH_O,
     "finish_grads(bucket) -> bool: True when the bucket's optimizer gradient of this syncing backward is\n"
     "final and the host's to read before sync_grads ([Note: a bucket's gradients before the sync])."},
    {"wait_grads", engine_wait_grads, METH_O,
     "wait_grads(bucket): wait until what finish_grads made final has landed in host memory (offloaded on a\n"
     "GPU); callable from another thread while the engine runs, without the GIL."},
    {"zero_grads", engine_zero_grads, METH_NOARGS, "zero_grads(): zero the main gradient buffers."},
    {"zero_item_grads", engine_zero_item_grads, METH_VARARGS,
     "zero_item_grads(bucket, items): zero the main gradients of some items of a bucket."},
    {"drain", engine_drain, METH_NOARGS, "drain(): finish every in-flight collective."},
    {"set_comm_dtype", engine_set_comm_dtype, METH_O,
     "set_comm_dtype(dtype or None): communicate gradients in `dtype` (None: the main gradient dtype)."},
    {"tensor", engine_tensor, METH_VARARGS, "tensor(bucket, kind) -> the buffer's torch tensor, or None."},
    {"local_piece", engine_local_piece, METH_VARARGS,
     "local_piece(bucket, item, kind) -> (buffer kind, offset, n): where this rank's rows of the item live."},
    {"weight_state", engine_weight_state, METH_O, "weight_state(bucket) -> 'empty'|'gathering'|'ready'|'stale'."},
    {"grad_state", engine_grad_state, METH_O, "grad_state(bucket) -> 'clean'|'dirty'|'reducing'|'reduced'."},
    {"stats", engine_stats, METH_VARARGS, "stats(bucket=-1) -> collective counts and bytes."},
    {"read_flags", engine_read_flags, METH_O,
     "read_flags(bucket) -> (used, split) or None: the bucket's reduced used-parameter flags, decoded ([Note:\n"
     "used-flag tail] in csrc/comm/reduce.c): used[i] 1 where some rank used item i since its gradient was last\n"
     "zeroed, split[i] 1 where ranks disagreed on whether it trains (a reduction across every rank); bytes of\n"
     "the bucket's items each. None: the bucket carries none. One synchronous copy to the host."},
    {"count_nonfinite_grad", engine_count_nonfinite_grad, METH_VARARGS,
     "count_nonfinite_grad(bucket, item) -> NaN/Inf count in this rank's main gradient of the item."},
    {"close", engine_close, METH_NOARGS, "close(): free every buffer now."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef engine_getset[] = {
    {"broken", engine_broken, NULL, "Text of the collective failure that stopped the engine, or None.", NULL},
    {"num_buckets", engine_num_buckets, NULL, "Number of buckets.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot engine_slots[] = {
    {Py_tp_doc, (void*)engine_doc},
    {Py_tp_init, engine_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_traverse, engine_traverse},
    {Py_tp_clear, engine_clear},
    {Py_tp_dealloc, engine_dealloc},
    {Py_tp_methods, engine_methods},
    {Py_tp_getset, engine_getset},
    {0, NULL},
};

static PyType_Spec engine_spec = {
    .name = "megatron_fsdp_c._C.Engine",
    .basicsize = sizeof(engine_object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = engine_slots,
};

int mfsdp_register_engine(PyObject* module, module_state* st) {
  st->engine_type = (PyTypeObject*)PyType_FromModuleAndSpec(module, &engine_spec, NULL);
  if (st->engine_type == NULL) return -1;
  return PyModule_AddType(module, st->engine_type);
}
