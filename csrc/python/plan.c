/* plan.c: _C.plan, the layout planner (csrc/core/mfsdp_layout.h) as a function: Python hands it
 * every parameter's shape facts and gets the buckets back as dicts, which the wrapper extends
 * into the Engine's bucket specs. */
#include "pieces.h"

PyDoc_STRVAR(plan_doc,
             "plan(params, shard_world, rank, bucket_cap, align_bytes, flag_tail=0, tail_align=0) -> list[dict]\n\n"
             "Groups parameters into buckets and lays each out (csrc/core/mfsdp_layout.h).\n"
             "params: sequence of (numel, row, dtype_code, unit, requires_grad, replicated[, outer[, role]]);\n"
             "outer: the blocks before the sharded dim (shape[:d].numel() for Shard(d); 1: dim 0);\n"
             "role: a bucket holds one role only (the caller's meaning; 0: ordinary parameters).\n"
             "Each bucket dict carries its key, item parameter indices, both layouts (param_offsets,\n"
             "shard_offsets, pieces, outers, weight_size, shard_size) and `local`: (first, n) of this\n"
             "rank's rows of every item (first: of its first run, n: all of them), and tail_offset, tail:\n"
             "flag_tail elements per item reserved in every shard of a floating bucket ([Note: flag tail]\n"
             "in csrc/core/mfsdp_layout.h), at offsets (and shard sizes) that are multiples of tail_align\n"
             "elements when it is > 1 (a quantization block). The plan is validated.");

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
  PyObject* outers = to_tuple_i64(l->outers, l->n_items);
  PyObject* d = NULL;
  if (!params || !local || !numels || !pieces || !param_offsets || !shard_offsets || !row_sizes || !outers) goto exit;
  for (int32_t i = 0; i < l->n_items; ++i) {
    mfsdp_runs ru;
    mfsdp_piece_runs(l->numels[i], l->pieces[i], mfsdp_layout_outer(l, i), r, &ru);
    PyObject* p = PyLong_FromLong(b->params[i]);
    PyObject* s = Py_BuildValue("(LL)", (long long)ru.first, (long long)(ru.count * ru.len));
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
  PyObject* role = d ? PyLong_FromLong(b->role) : NULL;
  if (d && (role == NULL || PyDict_SetItemString(d, "role", role) < 0)) Py_CLEAR(d);
  Py_XDECREF(role);
  if (d && (PyDict_SetItemString(d, "identity", mfsdp_layout_is_identity(l) ? Py_True : Py_False) < 0 ||
            PyDict_SetItemString(d, "outers", outers) < 0))
    Py_CLEAR(d);
  if (d) { /* [Note: flag tail] */
    PyObject* off = PyLong_FromLongLong(l->tail_offset);
    PyObject* tail = PyLong_FromLongLong(l->tail);
    if (!off || !tail || PyDict_SetItemString(d, "tail_offset", off) < 0 || PyDict_SetItemString(d, "tail", tail) < 0)
      Py_CLEAR(d);
    Py_XDECREF(off);
    Py_XDECREF(tail);
  }
exit:
  Py_XDECREF(params);
  Py_XDECREF(local);
  Py_XDECREF(numels);
  Py_XDECREF(pieces);
  Py_XDECREF(param_offsets);
  Py_XDECREF(shard_offsets);
  Py_XDECREF(row_sizes);
  Py_XDECREF(outers);
  return d;
}

static PyObject* py_plan(PyObject* module, PyObject* args) {
  PyObject* seq;
  int shard_world, rank, align_bytes, flag_tail = 0;
  long long cap, tail_align = 0;
  if (!PyArg_ParseTuple(args, "OiiLi|iL:plan", &seq, &shard_world, &rank, &cap, &align_bytes, &flag_tail, &tail_align))
    return NULL;
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
    long long numel, row, outer = 1;
    int dtype, unit, rg, rep, role = 0;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "LLiiii|Li:plan entry", &numel, &row, &dtype, &unit, &rg,
                          &rep, &outer, &role))
      goto exit;
    if (outer < 1) {
      PyErr_Format(PyExc_ValueError, "plan entry %zd: outer %lld < 1", i, outer);
      goto exit;
    }
    infos[i] = (mfsdp_param_info){numel, row, dtype, unit, rg, rep, outer, role};
  }
  mfsdp_status s = mfsdp_plan_build_tailed(infos, (int32_t)n, shard_world, cap, align_bytes, flag_tail, tail_align, &plan);
  if (s == MFSDP_OK) s = mfsdp_plan_validate(&plan, infos, (int32_t)n);
  if (s != MFSDP_OK) {
    mfsdp_raise(mfsdp_module_state(module), s);
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

static PyMethodDef plan_methods[] = {
    {"plan", py_plan, METH_VARARGS, plan_doc},
    {NULL, NULL, 0, NULL},
};

int mfsdp_register_plan(PyObject* module, module_state* st) {
  (void)st;
  return PyModule_AddFunctions(module, plan_methods);
}
