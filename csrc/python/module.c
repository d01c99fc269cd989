/* module.c: the megatron_fsdp_c._C module: status -> exception, tensor access, the layout
 * planner and the CPU kernels as functions (the engine type lives in engine.c). */
#include "glue.h"

#include <string.h>
#include <stdio.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

module_state* mfsdp_state_of_type(PyTypeObject* type) {
  PyObject* module = PyType_GetModuleByDef(type, &mfsdp_module_def);
  return module ? (module_state*)PyModule_GetState(module) : NULL;
}

PyObject* mfsdp_raise(module_state* st, mfsdp_status status) {
  if (status == MFSDP_ERR_PYTHON && PyErr_Occurred()) return NULL;
  const char* text = mfsdp_last_error();
  PyObject* type = st ? st->error : PyExc_RuntimeError;
  if (status == MFSDP_ERR_TIMEOUT) type = PyExc_TimeoutError;
  if (status == MFSDP_ERR_OUT_OF_MEMORY) type = PyExc_MemoryError;
  const char* hint = "";
  if (status == MFSDP_ERR_COMM || status == MFSDP_ERR_TIMEOUT || status == MFSDP_ERR_NCCL)
    hint = "; a peer rank may have died or stalled (see its log). This model cannot continue: restart the job "
           "from the last checkpoint";
  PyErr_Format(type, "%s (%s%s)", text[0] ? text : "engine failure", mfsdp_status_name(status), hint);
  return NULL;
}

mfsdp_status mfsdp_status_from_python(mfsdp_status status, const char* what) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject* exc = PyErr_GetRaisedException();
#else
  PyObject *exc_type, *exc, *exc_tb;
  PyErr_Fetch(&exc_type, &exc, &exc_tb);
  PyErr_NormalizeException(&exc_type, &exc, &exc_tb);
  Py_XDECREF(exc_type);
  Py_XDECREF(exc_tb);
#endif
  PyObject* text = exc ? PyObject_Str(exc) : NULL;
  const char* type_name = exc ? Py_TYPE(exc)->tp_name : "error";
  const char* msg = text ? PyUnicode_AsUTF8(text) : NULL;
  if (msg == NULL) PyErr_Clear();
  if (msg && (strstr(msg, "imed out") || strstr(msg, "imeout"))) status = MFSDP_ERR_TIMEOUT;
  mfsdp_set_error(status, __FILE__, __LINE__, what, "%s: %s", type_name, msg ? msg : "(no message)");
  Py_XDECREF(text);
  Py_XDECREF(exc);
  return status;
}

int mfsdp_dtype_code(module_state* st, PyObject* dtype, const char* what) {
  PyObject* code = PyDict_GetItemWithError(st->dtype_codes, dtype);
  if (code == NULL) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_TypeError, "%s: dtype %R is not supported (use float32, bfloat16, float16, float64 or an "
                   "integer/bool type for frozen parameters)", what, dtype);
    return -1;
  }
  return (int)PyLong_AsLong(code);
}

static int get_long(PyObject* obj, const char* method, long long* out) {
  PyObject* r = PyObject_CallMethod(obj, method, NULL);
  if (r == NULL) return -1;
  *out = PyLong_AsLongLong(r);
  Py_DECREF(r);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

int mfsdp_tensor_view(module_state* st, PyObject* t, const char* what, tensor_view* out) {
  int is_tensor = PyObject_IsInstance(t, st->tensor_type);
  if (is_tensor < 0) return -1;
  if (!is_tensor) {
    PyErr_Format(PyExc_TypeError, "%s: expected a torch.Tensor, got %.100s", what, Py_TYPE(t)->tp_name);
    return -1;
  }
  PyObject* contiguous = PyObject_CallMethod(t, "is_contiguous", NULL);
  if (contiguous == NULL) return -1;
  int ok = PyObject_IsTrue(contiguous);
  Py_DECREF(contiguous);
  if (ok <= 0) {
    if (ok == 0) PyErr_Format(PyExc_ValueError, "%s: tensor must be contiguous (call .contiguous())", what);
    return -1;
  }
  PyObject* dtype = PyObject_GetAttrString(t, "dtype");
  if (dtype == NULL) return -1;
  int code = mfsdp_dtype_code(st, dtype, what);
  Py_DECREF(dtype);
  if (code < 0) return -1;
  long long ptr, numel, device = -1;
  if (get_long(t, "data_ptr", &ptr) < 0 || get_long(t, "numel", &numel) < 0) return -1;
  PyObject* is_cuda = PyObject_GetAttrString(t, "is_cuda");
  if (is_cuda == NULL) return -1;
  int cuda = PyObject_IsTrue(is_cuda);
  Py_DECREF(is_cuda);
  if (cuda < 0) return -1;
  if (cuda && get_long(t, "get_device", &device) < 0) return -1;
  out->data = (void*)(intptr_t)ptr;
  out->dtype = code;
  out->numel = numel;
  out->device = (int32_t)device;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* plan(params, shard_world, rank, bucket_cap, align_bytes) */

PyDoc_STRVAR(plan_doc,
             "plan(params, shard_world, rank, bucket_cap, align_bytes) -> list[dict]\n\n"
             "Groups parameters into buckets and lays each out (csrc/core/mfsdp_layout.h).\n"
             "params: sequence of (numel, row, dtype_code, unit, requires_grad, replicated).\n"
             "Each bucket dict carries its key, item parameter indices, both layouts (param_offsets,\n"
             "shard_offsets, pieces, weight_size, shard_size) and `local`: (first, n) of this rank's\n"
             "rows of every item. The plan is validated.");

static PyObject* to_tuple_i64(const int64_t* v, int32_t n) {
  PyObject* t = PyTuple_New(n);
  for (int32_t i = 0; t && i < n; ++i) {
    PyObject* x = PyLong_FromLongLong(v[i]);
    if (x == NULL) {
      Py_CLEAR(t);
      break;
    }
    PyTuple_SET_ITEM(t, i, x);
  }
  return t;
}

static PyObject* bucket_to_dict(const mfsdp_bucket_plan* b, int32_t rank) {
  const mfsdp_bucket_layout* l = &b->layout;
  int32_t r = l->world > 1 ? rank : 0;
  PyObject* params = PyTuple_New(l->n_items);
  PyObject* local = PyTuple_New(l->n_items);
  PyObject* numels = to_tuple_i64(l->numels, l->n_items);
  PyObject* pieces = to_tuple_i64(l->pieces, l->n_items);
  PyObject* param_offsets = to_tuple_i64(l->param_offsets, l->n_items);
  PyObject* shard_offsets = to_tuple_i64(l->shard_offsets, l->n_items);
  PyObject* row_sizes = to_tuple_i64(b->row_sizes, l->n_items);
  PyObject* d = NULL;
  if (!params || !local || !numels || !pieces || !param_offsets || !shard_offsets || !row_sizes) goto exit;
  for (int32_t i = 0; i < l->n_items; ++i) {
    int64_t first, n;
    mfsdp_piece_of(l->numels[i], l->pieces[i], r, &first, &n);
    PyObject* p = PyLong_FromLong(b->params[i]);
    PyObject* s = Py_BuildValue("(LL)", (long long)first, (long long)n);
    if (!p || !s) {
      Py_XDECREF(p);
      Py_XDECREF(s);
      goto exit;
    }
    PyTuple_SET_ITEM(params, i, p);
    PyTuple_SET_ITEM(local, i, s);
  }
  d = Py_BuildValue("{s:i,s:i,s:O,s:O,s:i,s:i,s:O,s:O,s:O,s:O,s:O,s:O,s:L,s:L,s:L,s:i,s:O}", "unit", b->unit, "dtype",
                    b->dtype, "requires_grad", b->requires_grad ? Py_True : Py_False, "replicated",
                    b->replicated ? Py_True : Py_False, "shards", l->world, "shard_rank", r, "params", params,
                    "numels", numels, "pieces", pieces, "param_offsets", param_offsets, "shard_offsets",
                    shard_offsets, "row_sizes", row_sizes, "weight_size", (long long)l->weight_size, "shard_size",
                    (long long)l->shard_size, "bucket_size", (long long)l->world * l->shard_size, "n_items",
                    l->n_items, "local", local);
  if (d && PyDict_SetItemString(d, "identity", mfsdp_layout_is_identity(l) ? Py_True : Py_False) < 0) Py_CLEAR(d);
exit:
  Py_XDECREF(params);
  Py_XDECREF(local);
  Py_XDECREF(numels);
  Py_XDECREF(pieces);
  Py_XDECREF(param_offsets);
  Py_XDECREF(shard_offsets);
  Py_XDECREF(row_sizes);
  return d;
}

static PyObject* py_plan(PyObject* module, PyObject* args) {
  PyObject* seq;
  int shard_world, rank, align_bytes;
  long long cap;
  if (!PyArg_ParseTuple(args, "OiiLi:plan", &seq, &shard_world, &rank, &cap, &align_bytes)) return NULL;
  if (shard_world < 1 || rank < 0 || rank >= shard_world)
    return PyErr_Format(PyExc_ValueError, "plan: rank %d outside world of %d", rank, shard_world);
  PyObject* fast = PySequence_Fast(seq, "plan: params must be a sequence of tuples");
  if (fast == NULL) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  mfsdp_param_info* infos = PyMem_Calloc((size_t)(n ? n : 1), sizeof *infos);
  PyObject* result = NULL;
  mfsdp_plan plan = {0, NULL};
  if (infos == NULL) {
    PyErr_NoMemory();
    goto exit;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long numel, row;
    int dtype, unit, rg, rep;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "LLiiii:plan entry", &numel, &row, &dtype, &unit, &rg,
                          &rep))
      goto exit;
    infos[i] = (mfsdp_param_info){numel, row, dtype, unit, rg, rep};
  }
  mfsdp_status s = mfsdp_plan_build(infos, (int32_t)n, shard_world, cap, align_bytes, &plan);
  if (s == MFSDP_OK) s = mfsdp_plan_validate(&plan, infos, (int32_t)n);
  if (s != MFSDP_OK) {
    mfsdp_raise((module_state*)PyModule_GetState(module), s);
    goto exit;
  }
  result = PyList_New(plan.n_buckets);
  for (int32_t b = 0; result && b < plan.n_buckets; ++b) {
    PyObject* d = bucket_to_dict(&plan.buckets[b], rank);
    if (d == NULL) {
      Py_CLEAR(result);
      break;
    }
    PyList_SET_ITEM(result, b, d);
  }
exit:
  mfsdp_plan_free(&plan);
  PyMem_Free(infos);
  Py_DECREF(fast);
  return result;
}

/* ------------------------------------------------------------------------------------------ */
/* CPU kernels on tensors: the same code the engine runs, exposed for tests and benchmarks. */

static int host_pair(module_state* st, PyObject* dst, PyObject* src, tensor_view* d, tensor_view* s, const char* what) {
  if (mfsdp_tensor_view(st, dst, what, d) < 0 || mfsdp_tensor_view(st, src, what, s) < 0) return -1;
  if (d->device >= 0 || s->device >= 0) {
    PyErr_Format(PyExc_ValueError, "%s: CPU kernel given a CUDA tensor (use the CUDA build's cuda_* functions)", what);
    return -1;
  }
  if (d->numel != s->numel) {
    PyErr_Format(PyExc_ValueError, "%s: %lld destination elements but %lld source elements", what,
                 (long long)d->numel, (long long)s->numel);
    return -1;
  }
  return 0;
}

static PyObject* kernel_result(module_state* st, mfsdp_status s) {
  if (s != MFSDP_OK) return mfsdp_raise(st, s);
  Py_RETURN_NONE;
}

static PyObject* py_copy(PyObject* module, PyObject* args) {
  module_state* st = PyModule_GetState(module);
  PyObject *dst, *src;
  double alpha = 1.0;
  tensor_view d, s;
  if (!PyArg_ParseTuple(args, "OO|d:copy_", &dst, &src, &alpha) || host_pair(st, dst, src, &d, &s, "copy_") < 0)
    return NULL;
  return kernel_result(st, mfsdp_cpu_copy(d.data, d.dtype, s.data, s.dtype, d.numel, alpha));
}

static PyObject* py_accumulate(PyObject* module, PyObject* args) {
  module_state* st = PyModule_GetState(module);
  PyObject *dst, *src;
  double alpha = 1.0;
  tensor_view d, s;
  if (!PyArg_ParseTuple(args, "OO|d:accumulate_", &dst, &src, &alpha) ||
      host_pair(st, dst, src, &d, &s, "accumulate_") < 0)
    return NULL;
  return kernel_result(st, mfsdp_cpu_accumulate(d.data, d.dtype, s.data, s.dtype, d.numel, alpha));
}

static PyObject* py_scale(PyObject* module, PyObject* args) {
  module_state* st = PyModule_GetState(module);
  PyObject* x;
  double alpha;
  tensor_view v, unused;
  if (!PyArg_ParseTuple(args, "Od:scale_", &x, &alpha) || host_pair(st, x, x, &v, &unused, "scale_") < 0) return NULL;
  return kernel_result(st, mfsdp_cpu_scale(v.data, v.dtype, v.numel, alpha));
}

static PyObject* py_count_nonfinite(PyObject* module, PyObject* x) {
  module_state* st = PyModule_GetState(module);
  tensor_view v, unused;
  int64_t count = 0;
  if (host_pair(st, x, x, &v, &unused, "count_nonfinite") < 0) return NULL;
  mfsdp_status s = mfsdp_cpu_count_nonfinite(v.data, v.dtype, v.numel, &count);
  if (s != MFSDP_OK) return mfsdp_raise(st, s);
  return PyLong_FromLongLong(count);
}

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

static PyMethodDef module_methods[] = {
    {"plan", py_plan, METH_VARARGS, plan_doc},
    {"copy_", py_copy, METH_VARARGS, "copy_(dst, src, alpha=1.0): dst = alpha * src, cast once (CPU kernel)."},
    {"accumulate_", py_accumulate, METH_VARARGS,
     "accumulate_(dst, src, alpha=1.0): dst += alpha * src in the wider type, rounded once (CPU kernel)."},
    {"scale_", py_scale, METH_VARARGS, "scale_(x, alpha): x *= alpha (CPU kernel)."},
    {"count_nonfinite", py_count_nonfinite, METH_O, "count_nonfinite(x) -> number of NaN/Inf elements."},
    {"keep_host_heap", py_keep_host_heap, METH_NOARGS,
     "keep_host_heap() -> 1: glibc keeps freed blocks up to 32 MiB for reuse (process-wide, once; -1: not glibc). "
     "Pair it with trim_host_heap. See [Note: host heap trim]."},
    {"trim_host_heap", py_trim_host_heap, METH_O,
     "trim_host_heap(bound) -> resident bytes given back to the OS: trims the heap once resident memory grew "
     "by more than bound since the last trim (0: not yet, -1: not glibc/Linux). See [Note: host heap trim]."},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------------------------------ */
/* module lifecycle */

static int build_dtype_tables(module_state* st) {
  static const char* names[MFSDP_NUM_DTYPES] = {"float32", "bfloat16", "float16", "float64", "uint8",
                                                 "int8",    "int16",    "int32",   "int64",   "bool"};
  st->dtype_codes = PyDict_New();
  st->dtypes = PyTuple_New(MFSDP_NUM_DTYPES);
  if (!st->dtype_codes || !st->dtypes) return -1;
  for (int i = 0; i < MFSDP_NUM_DTYPES; ++i) {
    PyObject* dt = PyObject_GetAttrString(st->torch, names[i]);
    PyObject* code = PyLong_FromLong(i);
    if (!dt || !code || PyDict_SetItem(st->dtype_codes, dt, code) < 0) {
      Py_XDECREF(dt);
      Py_XDECREF(code);
      return -1;
    }
    Py_DECREF(code);
    PyTuple_SET_ITEM(st->dtypes, i, dt);
  }
  return 0;
}

static int module_exec(PyObject* module) {
  module_state* st = PyModule_GetState(module);
  st->error = PyErr_NewExceptionWithDoc("megatron_fsdp_c._C.EngineError",
                                        "A failure inside the C engine; the message names the C file and line.",
                                        PyExc_RuntimeError, NULL);
  if (st->error == NULL || PyModule_AddObjectRef(module, "EngineError", st->error) < 0) return -1;
  st->torch = PyImport_ImportModule("torch");
  if (st->torch == NULL) return -1;
  st->tensor_type = PyObject_GetAttrString(st->torch, "Tensor");
  if (st->tensor_type == NULL || build_dtype_tables(st) < 0) return -1;
  if (PyModule_AddObjectRef(module, "DTYPE_CODES", st->dtype_codes) < 0) return -1;
  if (mfsdp_register_torch_transport(module, st) < 0 || mfsdp_register_engine(module, st) < 0 ||
      mfsdp_register_nccl(module, st) < 0)
    return -1;
  PyModule_AddIntConstant(module, "GRAD_NONE", MFSDP_GRAD_NONE);
  PyModule_AddIntConstant(module, "GRAD_ALL_REDUCE", MFSDP_GRAD_ALL_REDUCE);
  PyModule_AddIntConstant(module, "GRAD_SCATTER_IN_PLACE", MFSDP_GRAD_SCATTER_IN_PLACE);
  PyModule_AddIntConstant(module, "GRAD_SCATTER_ACCUMULATE", MFSDP_GRAD_SCATTER_ACCUMULATE);
  static const char* kinds[MFSDP_BUF_COUNT] = {"WEIGHT",     "GATHER",   "WEIGHT_SHARD", "MAIN_SHARD",
                                               "GRAD",       "GRAD_SLICE", "GRAD_SHARD", "OPT_GRAD",
                                               "COMM",       "COMM_SLICE", "EXCHANGE",   "WEIGHT_SUB",
                                               "GRAD_SUB"};
  for (int k = 0; k < MFSDP_BUF_COUNT; ++k) {
    char name[32];
    snprintf(name, sizeof name, "BUF_%s", kinds[k]);
    if (PyModule_AddIntConstant(module, name, k) < 0) return -1;
  }
  return 0;
}

static int module_traverse(PyObject* module, visitproc visit, void* arg) {
  module_state* st = PyModule_GetState(module);
  Py_VISIT(st->error);
  Py_VISIT(st->torch);
  Py_VISIT(st->tensor_type);
  Py_VISIT(st->dtype_codes);
  Py_VISIT(st->dtypes);
  Py_VISIT(st->engine_type);
  Py_VISIT(st->torch_transport_type);
  Py_VISIT(st->nccl_transport_type);
  return 0;
}

static int module_clear(PyObject* module) {
  module_state* st = PyModule_GetState(module);
  Py_CLEAR(st->error);
  Py_CLEAR(st->torch);
  Py_CLEAR(st->tensor_type);
  Py_CLEAR(st->dtype_codes);
  Py_CLEAR(st->dtypes);
  Py_CLEAR(st->engine_type);
  Py_CLEAR(st->torch_transport_type);
  Py_CLEAR(st->nccl_transport_type);
  return 0;
}

static void module_free(void* module) { module_clear((PyObject*)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc, "The C engine of megatron_fsdp_c: layout planner, kernels and collective pipeline.");

PyModuleDef mfsdp_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "megatron_fsdp_c._C",
    .m_doc = module_doc,
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&mfsdp_module_def); }
