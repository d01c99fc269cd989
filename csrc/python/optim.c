/* optim.c: the fused Adam step (csrc/core/adam_cpu.c) on lists of CPU tensors, for
 * megatron_fsdp_c/fused_adam.py: one call per parameter group, the GIL released while it runs. */
#include "pieces.h"

#include "../core/mfsdp_adam.h"

/* Tensor i's step count (a one-element float32 or float64 host tensor, as torch's Adam keeps
 * state["step"]): where it lives, and the count after this step. */
static int step_item(module_state* st, PyObject* seq, Py_ssize_t i, void** where, int32_t* dtype, long long* next) {
  tensor_view v;
  if (mfsdp_tensor_view(st, PySequence_Fast_GET_ITEM(seq, i), "steps", &v) < 0) return -1;
  if (v.numel != 1 || v.data == NULL || v.device >= 0 || (v.dtype != MFSDP_F32 && v.dtype != MFSDP_F64)) {
    PyErr_Format(PyExc_ValueError, "adam_step_: steps %zd must be a one-element float32 or float64 host tensor (the "
                 "state's step count)", i);
    return -1;
  }
  double count = v.dtype == MFSDP_F32 ? (double)*(const float*)v.data : *(const double*)v.data;
  if (!(count >= 0 && count < 9007199254740992.0) || count != (double)(long long)count) {
    char text[128];
    snprintf(text, sizeof text, "adam_step_: steps %zd holds %g, not a step count", i, count);
    PyErr_SetString(PyExc_ValueError, text);
    return -1;
  }
  *where = v.data;
  *dtype = v.dtype;
  *next = (long long)count + 1;
  return 0;
}

/* The i-th tensor of a sequence (None allowed when `optional`), contiguous and on the CPU. */
static int host_item(module_state* st, PyObject* seq, Py_ssize_t i, const char* what, int optional,
                     tensor_view* out) {
  PyObject* t = PySequence_Fast_GET_ITEM(seq, i);
  if (t == Py_None && optional) {
    *out = (tensor_view){NULL, -1, 0, -1};
    return 0;
  }
  if (mfsdp_tensor_view(st, t, what, out) < 0) return -1;
  if (out->data == NULL && out->numel > 0) {
    PyErr_Format(PyExc_ValueError, "adam_step_: %s %zd has no storage of its own (a tensor subclass?); the fused "
                 "step takes plain tensors", what, i);
    return -1;
  }
  if (out->device >= 0) {
    PyErr_Format(PyExc_ValueError, "adam_step_: %s %zd is a CUDA tensor; the fused step runs on host memory", what, i);
    return -1;
  }
  return 0;
}

/* [Note: memory under the step]
 * The step reads each tensor's data pointer with the GIL held, then lets the GIL go for the
 * arithmetic (on the optimizer's worker when it steps inside the backward, beside the autograd
 * thread), then writes the step counts. Python keeps every tensor object alive (the lists), but
 * not its memory: a storage resized to 0 (the engine's release, [Note: storage resize] in
 * csrc/comm/buffers.c) or a tensor given new data meanwhile would leave the step writing freed
 * heap -- silent corruption that glibc reports, if at all, much later and elsewhere. The callers
 * never release a buffer under a step ([Note: stepping in backward] in _backward_step.py: the
 * steps are joined first); `recheck` holds them to it where a step runs beside the engine (the
 * optimizer's worker): after the step every tensor it touched must still have the data pointer it
 * had (a storage resized to 0 has none), or the step raises before writing the counts. One
 * data_ptr() call per tensor and list (measured, 200 tensors of 1,000 elements: 1.21 ms a step
 * against 0.95 without), so optimizer.step() on the caller's thread, where nothing of ours runs
 * meanwhile, goes without (as torch's ops, which also let the GIL go, do). */
static int still_there(module_state* st, PyObject* seq, Py_ssize_t i, const char* what, const void* data) {
  void* now;
  if (mfsdp_tensor_data_ptr(st, PySequence_Fast_GET_ITEM(seq, i), &now) < 0) return -1;
  if (now == data) return 0;
  PyErr_Format(PyExc_RuntimeError, "adam_step_: the memory of %s %zd was freed or replaced while the step ran (an "
               "engine bug: nothing may release a tensor an optimizer step is using; [Note: memory under the step] "
               "in csrc/python/optim.c)", what, i);
  return -1;
}

static PyObject* py_adam_step(PyObject* module, PyObject* args) {
  module_state* st = mfsdp_module_state(module);
  PyObject *params, *grads, *avgs, *sqs, *maxs, *steps, *computes = Py_None;
  mfsdp_adam_config cfg = {0};
  int threads = 1, recheck = 0;
  if (!PyArg_ParseTuple(args, "OOOOOOdddddpppi|Op:adam_step_", &params, &grads, &avgs, &sqs, &maxs, &steps, &cfg.lr,
                        &cfg.beta1, &cfg.beta2, &cfg.eps, &cfg.weight_decay, &cfg.amsgrad, &cfg.maximize,
                        &cfg.decoupled, &threads, &computes, &recheck))
    return NULL;
  PyObject* lists[7] = {params, grads, avgs, sqs, maxs == Py_None ? NULL : maxs, steps,
                        computes == Py_None ? NULL : computes};
  static const char* names[7] = {"params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps", "computes"};
  PyObject* fast[7] = {NULL};
  mfsdp_adam_tensor* ts = NULL;
  struct {
    void* where;
    int32_t dtype;
  }* counts = NULL; /* the step tensors, written once the step succeeded */
  PyObject* result = NULL;
  Py_ssize_t n = -1;
  for (int k = 0; k < 7; ++k) {
    if (!lists[k]) continue;
    fast[k] = PySequence_Fast(lists[k], "adam_step_: expected sequences");
    if (!fast[k]) goto exit;
    if (n >= 0 && PySequence_Fast_GET_SIZE(fast[k]) != n) {
      PyErr_Format(PyExc_ValueError, "adam_step_: %zd params but %zd %s", n, PySequence_Fast_GET_SIZE(fast[k]),
                   names[k]);
      goto exit;
    }
    n = PySequence_Fast_GET_SIZE(fast[k]);
  }
  if ((cfg.amsgrad != 0) != (maxs != Py_None)) {
    PyErr_SetString(PyExc_ValueError, "adam_step_: max_exp_avg_sqs are given exactly when amsgrad is set");
    goto exit;
  }
  if (n > INT32_MAX) {
    PyErr_SetString(PyExc_ValueError, "adam_step_: too many tensors");
    goto exit;
  }
  ts = PyMem_Calloc((size_t)(n ? n : 1), sizeof *ts);
  counts = PyMem_Calloc((size_t)(n ? n : 1), sizeof *counts);
  if (!ts || !counts) {
    PyErr_NoMemory();
    goto exit;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    tensor_view v[7];
    for (int k = 0; k < 7; ++k) {
      if (k == 5) continue;  /* steps: step_item */
      if (!fast[k]) {
        v[k] = (tensor_view){NULL, -1, 0, -1};
        continue;
      }
      if (host_item(st, fast[k], i, names[k], k == 6, &v[k]) < 0) goto exit;
      if (v[k].data && v[k].numel != v[0].numel) {
        PyErr_Format(PyExc_ValueError, "adam_step_: param %zd has %lld elements but its %s %lld", i,
                     (long long)v[0].numel, names[k], (long long)v[k].numel);
        goto exit;
      }
    }
    int ok = 1;
    for (int k = 2; k <= 4; ++k) ok &= !v[k].data || v[k].dtype == v[0].dtype;
    if (!ok) {
      PyErr_Format(PyExc_ValueError, "adam_step_: param %zd is %s but a state of it is not (states follow the param)",
                   i, mfsdp_dtype_name(v[0].dtype));
      goto exit;
    }
    long long step;
    if (step_item(st, fast[5], i, &counts[i].where, &counts[i].dtype, &step) < 0) goto exit;
    ts[i] = (mfsdp_adam_tensor){.param = v[0].data, .grad = v[1].data, .exp_avg = v[2].data, .exp_avg_sq = v[3].data,
                                .max_exp_avg_sq = v[4].data, .compute = v[6].data, .n = v[0].numel, .step = step,
                                .param_dtype = v[0].dtype, .grad_dtype = v[1].dtype, .compute_dtype = v[6].dtype};
  }
  mfsdp_status s;
  Py_BEGIN_ALLOW_THREADS
  s = mfsdp_adam_step(&cfg, ts, (int32_t)n, threads);
  Py_END_ALLOW_THREADS
  if (s != MFSDP_OK) {
    mfsdp_raise(st, s);
    goto exit;
  }
  for (Py_ssize_t i = 0; recheck && i < n; ++i) { /* [Note: memory under the step] */
    if (still_there(st, fast[0], i, "params", ts[i].param) < 0 || still_there(st, fast[1], i, "grads", ts[i].grad) < 0 ||
        still_there(st, fast[2], i, "exp_avgs", ts[i].exp_avg) < 0 ||
        still_there(st, fast[3], i, "exp_avg_sqs", ts[i].exp_avg_sq) < 0 ||
        (fast[4] && still_there(st, fast[4], i, "max_exp_avg_sqs", ts[i].max_exp_avg_sq) < 0) ||
        (fast[6] && ts[i].compute && still_there(st, fast[6], i, "computes", ts[i].compute) < 0) ||
        still_there(st, fast[5], i, "steps", counts[i].where) < 0)
      goto exit;
  }
  for (Py_ssize_t i = 0; i < n; ++i) { /* in the step tensor's own type, as torch's += 1 counts */
    if (counts[i].dtype == MFSDP_F32)
      *(float*)counts[i].where = (float)ts[i].step;
    else
      *(double*)counts[i].where = (double)ts[i].step;
  }
  result = Py_NewRef(Py_None);
exit:
  for (int k = 0; k < 7; ++k) Py_XDECREF(fast[k]);
  PyMem_Free(ts);
  PyMem_Free(counts);
  return result;
}

static PyObject* py_adam_isa(PyObject* module, PyObject* unused) {
  (void)module;
  (void)unused;
  return PyUnicode_FromString(mfsdp_adam_isa());
}

static PyMethodDef optim_methods[] = {
    {"adam_step_", py_adam_step, METH_VARARGS,
     "adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, "
     "amsgrad, maximize, decoupled, threads, computes=None, recheck=False): one fused Adam/AdamW step of a "
     "parameter group in place ([Note: fused Adam] in csrc/core/mfsdp_adam.h); steps[i] is tensor i's count "
     "(state['step'], a one-element float tensor), advanced by one when the step succeeded; recheck: raise if a "
     "tensor's memory was replaced while the step ran ([Note: memory under the step])."},
    {"adam_isa", py_adam_isa, METH_NOARGS, "adam_isa() -> the fused Adam's SIMD path: avx512, avx2 or portable."},
    {NULL, NULL, 0, NULL},
};

int mfsdp_register_optim(PyObject* module, module_state* st) {
  (void)st;
  return PyModule_AddFunctions(module, optim_methods);
}
