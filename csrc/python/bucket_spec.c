/* bucket_spec.c: the Engine's bucket specs from Python (bucket_spec.h), and the names of the
 * pipeline's enums Python uses with them: GRAD_* (a spec's grad_mode) and BUF_* (buffer kinds,
 * for Engine.tensor and Engine.local_piece). */
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
  memset(&s->layout, 0, sizeof s->layout);
}

/* A bucket dict as _C.plan makes it (plus the dtypes and modes the wrapper adds; "frozen" is
 * optional, default 0: [Note: requires_grad changes] in csrc/comm/trainable.c). */
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
  *s = (mfsdp_bucket_spec){{(int32_t)v[0], n[0], a[0], a[1], a[2], a[3], v[10], v[2]}, (int32_t)v[1],
                           (int32_t)v[3], (int32_t)v[4], (int32_t)v[5], (int32_t)v[6], (int32_t)v[7], (int32_t)v[8],
                           (int32_t)v[9]};
  PyObject* frozen = PyDict_GetItemString(d, "frozen");
  int bad_flag = frozen != NULL && (s->frozen = PyObject_IsTrue(frozen)) < 0; /* the error is set */
  if (bad_flag || !a[0] || !a[1] || !a[2] || !a[3] || n[1] != n[0] || n[2] != n[0] || n[3] != n[0]) {
    free_spec(s);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bucket spec: item tables of different lengths");
    return -1;
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

int mfsdp_register_bucket_spec(PyObject* module, module_state* st) {
  (void)st;
  if (PyModule_AddIntConstant(module, "GRAD_NONE", MFSDP_GRAD_NONE) < 0 ||
      PyModule_AddIntConstant(module, "GRAD_ALL_REDUCE", MFSDP_GRAD_ALL_REDUCE) < 0 ||
      PyModule_AddIntConstant(module, "GRAD_SCATTER_IN_PLACE", MFSDP_GRAD_SCATTER_IN_PLACE) < 0 ||
      PyModule_AddIntConstant(module, "GRAD_SCATTER_ACCUMULATE", MFSDP_GRAD_SCATTER_ACCUMULATE) < 0)
    return -1;
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
