/* bucket_spec.c: the Engine's bucket specs from Python (bucket_spec.h), and the names of the
 * pipeline's enums Python uses with them: GRAD_* (a spec's grad_mode), BUF_* (buffer kinds,
 * for Engine.tensor and Engine.local_piece), QUANT_MODES and quant_wire_bytes (a spec's
 * quantized wires). */
#include "bucket_spec.h"
#include "pieces.h"

#include <stdio.h>
#include <string.h>

static int dict_long(PyObject* d, const char* key, long long* out) {
  PyObject* v = PyDict_GetItemString(d, key);
  if (v == NULL) {
    PyErr_Format(PyExc_KeyError, "bucket spec is missing '%s'", key);
    return -1;
  }
  *out = PyLong_AsLongLong(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int64_t* dict_i64s(PyObject* d, const char* key, int32_t* n) {
  PyObject* v = PyDict_GetItemString(d, key);
  if (v == NULL) {
    PyErr_Format(PyExc_KeyError, "bucket spec is missing '%s'", key);
    return NULL;
  }
  PyObject* fast = PySequence_Fast(v, "bucket spec field must be a sequence");
  if (fast == NULL) return NULL;
  Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
  int64_t* out = PyMem_Malloc((size_t)(len ? len : 1) * sizeof *out);
  for (Py_ssize_t i = 0; out && i < len; ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (out[i] == -1 && PyErr_Occurred()) {
      PyMem_Free(out);
      out = NULL;
    }
  }
  if (out == NULL && !PyErr_Occurred()) PyErr_NoMemory();
  *n = (int32_t)len;
  Py_DECREF(fast);
  return out;
}

static void free_spec(mfsdp_bucket_spec* s) {
  PyMem_Free((void*)s->layout.numels);
  PyMem_Free((void*)s->layout.pieces);
  PyMem_Free((void*)s->layout.param_offsets);
  PyMem_Free((void*)s->layout.shard_offsets);
  PyMem_Free((void*)s->layout.outers);
  memset(&s->layout, 0, sizeof s->layout);
}

/* An optional int field (absent: `fallback`). */
static int dict_long_or(PyObject* d, const char* key, long long fallback, long long* out) {
  if (PyDict_GetItemString(d, key) == NULL) {
    *out = fallback;
    return 0;
  }
  return dict_long(d, key, out);
}

/* A bucket dict as _C.plan makes it (tail_offset and tail optional, plus the dtypes and modes the wrapper adds, and optionally
 * its quantized wires: wire_weights, wire_grads, wire_outer_weights as mfsdp_wire_spec codes, and
 * wire_block; "frozen", default 0: [Note: requires_grad changes] in csrc/comm/trainable.c; and
 * "sum_in_comm_dtype", default 0: [Note: exchange reduction] in csrc/comm/reduce.c; "offload",
 * default 0: [Note: offloaded buckets] in csrc/comm/buffers.c). */
static int parse_spec(PyObject* d, mfsdp_bucket_spec* s) {
  if (!PyDict_Check(d)) {
    PyErr_SetString(PyExc_TypeError, "bucket spec must be a dict");
    return -1;
  }
  long long v[11];
  static const char* keys[11] = {"shards",     "shard_rank", "shard_size",      "param_dtype",      "main_dtype",
                                 "grad_dtype", "comm_dtype", "weights_sharded", "weights_regather", "grad_mode",
                                 "weight_size"};
  for (int i = 0; i < 11; ++i)
    if (dict_long(d, keys[i], &v[i]) < 0) return -1;
  int32_t n[4] = {0, 0, 0, 0};
  static const char* arrays[4] = {"numels", "pieces", "param_offsets", "shard_offsets"};
  int64_t* a[4] = {NULL, NULL, NULL, NULL};
  for (int i = 0; i < 4; ++i)
    if ((a[i] = dict_i64s(d, arrays[i], &n[i])) == NULL) break;
  long long w[4] = {0, 0, 0, 0};
  static const char* wires[4] = {"wire_weights", "wire_grads", "wire_outer_weights", "wire_block"};
  for (int i = 0; i < 4 && !PyErr_Occurred(); ++i) dict_long_or(d, wires[i], 0, &w[i]);
  *s = (mfsdp_bucket_spec){{(int32_t)v[0], n[0], a[0], a[1], a[2], a[3], v[10], v[2]},
                           (int32_t)v[1],
                           (int32_t)v[3],
                           (int32_t)v[4],
                           (int32_t)v[5],
                           (int32_t)v[6],
                           (int32_t)v[7],
                           (int32_t)v[8],
                           (int32_t)v[9],
                           {(int32_t)w[0], (int32_t)w[1], (int32_t)w[2], w[3]}};
  long long tail[2] = {0, 0}; /* optional: the reserved tail ([Note: flag tail] in core/mfsdp_layout.h) */
  for (int i = 0; i < 2 && !PyErr_Occurred(); ++i) dict_long_or(d, i ? "tail" : "tail_offset", 0, &tail[i]);
  s->layout.tail_offset = tail[0];
  s->layout.tail = tail[1];
  PyObject* frozen = PyErr_Occurred() ? NULL : PyDict_GetItemString(d, "frozen");
  if (frozen != NULL) {
    int flag = PyObject_IsTrue(frozen); /* -1: the error is set */
    s->frozen = flag > 0;
  }
  PyObject* narrow = PyErr_Occurred() ? NULL : PyDict_GetItemString(d, "sum_in_comm_dtype");
  if (narrow != NULL) {
    int flag = PyObject_IsTrue(narrow); /* -1: the error is set */
    s->sum_in_comm_dtype = flag > 0;
  }
  PyObject* offload = PyErr_Occurred() ? NULL : PyDict_GetItemString(d, "offload");
  if (offload != NULL) {
    int flag = PyObject_IsTrue(offload); /* -1: the error is set */
    s->offload = flag > 0;
  }
  if (PyErr_Occurred()) {
    free_spec(s);
    return -1;
  }
  if (!a[0] || !a[1] || !a[2] || !a[3] || n[1] != n[0] || n[2] != n[0] || n[3] != n[0]) {
    free_spec(s);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bucket spec: item tables of different lengths");
    return -1;
  }
  /* optional: blocks of each item ([Note: chunked layout]); absent, every item is sharded on dim 0 */
  if (PyDict_GetItemString(d, "outers") != NULL) {
    int32_t n_outers = 0;
    s->layout.outers = dict_i64s(d, "outers", &n_outers);
    if (s->layout.outers == NULL || n_outers != n[0]) {
      free_spec(s);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bucket spec: item tables of different lengths");
      return -1;
    }
  }
  return 0;
}

int mfsdp_bucket_specs_from_python(PyObject* seq, mfsdp_bucket_spec** out, int32_t* n_out) {
  PyObject* fast = PySequence_Fast(seq, "Engine: buckets must be a sequence of dicts");
  if (fast == NULL) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  mfsdp_bucket_spec* specs = PyMem_Calloc((size_t)(n ? n : 1), sizeof *specs);
  Py_ssize_t parsed = 0;
  if (specs == NULL) PyErr_NoMemory();
  for (; specs && parsed < n; ++parsed)
    if (parse_spec(PySequence_Fast_GET_ITEM(fast, parsed), &specs[parsed]) < 0) break;
  Py_DECREF(fast);
  if (specs == NULL || parsed < n) {
    mfsdp_free_bucket_specs(specs, (int32_t)parsed);
    return -1;
  }
  *out = specs;
  *n_out = (int32_t)n;
  return 0;
}

void mfsdp_free_bucket_specs(mfsdp_bucket_spec* specs, int32_t n) {
  for (int32_t i = 0; specs && i < n; ++i) free_spec(&specs[i]);
  PyMem_Free(specs);
}

PyDoc_STRVAR(quant_wire_bytes_doc,
             "quant_wire_bytes(mode, n, block) -> bytes of one rank's piece of n elements on a quantized wire\n"
             "([Note: quantized wire format] in csrc/core/mfsdp_quant.h); mode is a QUANT_MODES code.");

static PyObject* py_quant_wire_bytes(PyObject* module, PyObject* args) {
  int mode;
  long long n, block;
  if (!PyArg_ParseTuple(args, "iLL:quant_wire_bytes", &mode, &n, &block)) return NULL;
  int64_t bytes = mfsdp_quant_wire_bytes(mode, n, block);
  if (bytes < 0)
    return PyErr_Format(PyExc_ValueError, "quant_wire_bytes: no %s pieces of %lld elements in blocks of %lld",
                        mfsdp_quant_mode_name(mode), n, block);
  return PyLong_FromLongLong((long long)bytes);
}

static PyMethodDef bucket_spec_methods[] = {
    {"quant_wire_bytes", py_quant_wire_bytes, METH_VARARGS, quant_wire_bytes_doc},
    {NULL, NULL, 0, NULL},
};

int mfsdp_register_bucket_spec(PyObject* module, module_state* st) {
  (void)st;
  PyObject* modes = PyDict_New();
  for (int m = 0; modes != NULL && m < MFSDP_NUM_QUANT_MODES; ++m) {
    PyObject* code = PyLong_FromLong(m);
    if (code == NULL || PyDict_SetItemString(modes, mfsdp_quant_mode_name(m), code) < 0) Py_CLEAR(modes);
    Py_XDECREF(code);
  }
  int added = modes != NULL && PyModule_AddObjectRef(module, "QUANT_MODES", modes) == 0;
  Py_XDECREF(modes);
  if (!added || PyModule_AddIntConstant(module, "QUANT_DEFAULT_BLOCK", MFSDP_QUANT_DEFAULT_BLOCK) < 0 ||
      PyModule_AddIntConstant(module, "FLAG_TAIL", MFSDP_FLAG_TAIL) < 0 ||
      PyModule_AddFunctions(module, bucket_spec_methods) < 0)
    return -1;
  if (PyModule_AddIntConstant(module, "GRAD_NONE", MFSDP_GRAD_NONE) < 0 ||
      PyModule_AddIntConstant(module, "GRAD_ALL_REDUCE", MFSDP_GRAD_ALL_REDUCE) < 0 ||
      PyModule_AddIntConstant(module, "GRAD_SCATTER_IN_PLACE", MFSDP_GRAD_SCATTER_IN_PLACE) < 0 ||
      PyModule_AddIntConstant(module, "GRAD_SCATTER_ACCUMULATE", MFSDP_GRAD_SCATTER_ACCUMULATE) < 0)
    return -1;
  static const char* kinds[MFSDP_BUF_COUNT] = {"WEIGHT",     "GATHER",   "WEIGHT_SHARD", "MAIN_SHARD",
                                               "GRAD",       "GRAD_SLICE", "GRAD_SHARD", "OPT_GRAD",
                                               "COMM",       "COMM_SLICE", "EXCHANGE",   "WEIGHT_SUB",
                                               "GRAD_SUB",   "GATHER_WIRE", "GATHER_WIRE_SHARD", "GRAD_WIRE",
                                               "OUTER_WIRE", "OUTER_WIRE_SUB", "FLAGS"};
  for (int k = 0; k < MFSDP_BUF_COUNT; ++k) {
    char name[32];
    snprintf(name, sizeof name, "BUF_%s", kinds[k]);
    if (PyModule_AddIntConstant(module, name, k) < 0) return -1;
  }
  return 0;
}
