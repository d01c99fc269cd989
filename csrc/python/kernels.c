/* kernels.c: the engine's kernels as functions on tensors, for tests and benchmarks: the CPU
 * kernels (csrc/core/kernels_cpu.c) always, the CUDA kernels (csrc/cuda/kernels.cu) in CUDA
 * builds, on torch's current stream; the quantized wire's on either device. The engine itself
 * calls the kernel tables directly. */
#include "pieces.h"

#include "../core/mfsdp_kernels.h"
#include "../core/mfsdp_quant.h"

#ifdef MFSDP_WITH_CUDA
#include "../cuda/mfsdp_cuda.h"
#endif

/* ------------------------------------------------------------------------------------------ */
/* CPU kernels on tensors */

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
  module_state* st = mfsdp_module_state(module);
  PyObject *dst, *src;
  double alpha = 1.0;
  tensor_view d, s;
  if (!PyArg_ParseTuple(args, "OO|d:copy_", &dst, &src, &alpha) || host_pair(st, dst, src, &d, &s, "copy_") < 0)
    return NULL;
  return kernel_result(st, mfsdp_cpu_copy(d.data, d.dtype, s.data, s.dtype, d.numel, alpha));
}

static PyObject* py_accumulate(PyObject* module, PyObject* args) {
  module_state* st = mfsdp_module_state(module);
  PyObject *dst, *src;
  double alpha = 1.0;
  tensor_view d, s;
  if (!PyArg_ParseTuple(args, "OO|d:accumulate_", &dst, &src, &alpha) ||
      host_pair(st, dst, src, &d, &s, "accumulate_") < 0)
    return NULL;
  return kernel_result(st, mfsdp_cpu_accumulate(d.data, d.dtype, s.data, s.dtype, d.numel, alpha));
}

static PyObject* py_scale(PyObject* module, PyObject* args) {
  module_state* st = mfsdp_module_state(module);
  PyObject* x;
  double alpha;
  tensor_view v, unused;
  if (!PyArg_ParseTuple(args, "Od:scale_", &x, &alpha) || host_pair(st, x, x, &v, &unused, "scale_") < 0) return NULL;
  return kernel_result(st, mfsdp_cpu_scale(v.data, v.dtype, v.numel, alpha));
}

static PyObject* py_count_nonfinite(PyObject* module, PyObject* x) {
  module_state* st = mfsdp_module_state(module);
  tensor_view v, unused;
  int64_t count = 0;
  if (host_pair(st, x, x, &v, &unused, "count_nonfinite") < 0) return NULL;
  mfsdp_status s = mfsdp_cpu_count_nonfinite(v.data, v.dtype, v.numel, &count);
  if (s != MFSDP_OK) return mfsdp_raise(st, s);
  return PyLong_FromLongLong(count);
}

static PyMethodDef cpu_kernel_methods[] = {
    {"copy_", py_copy, METH_VARARGS, "copy_(dst, src, alpha=1.0): dst = alpha * src, cast once (CPU kernel)."},
    {"accumulate_", py_accumulate, METH_VARARGS,
     "accumulate_(dst, src, alpha=1.0): dst += alpha * src in the wider type, rounded once (CPU kernel)."},
    {"scale_", py_scale, METH_VARARGS, "scale_(x, alpha): x *= alpha (CPU kernel)."},
    {"count_nonfinite", py_count_nonfinite, METH_O, "count_nonfinite(x) -> number of NaN/Inf elements."},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------------------------------ */
/* CUDA kernels on CUDA tensors, on torch's current stream */

#ifdef MFSDP_WITH_CUDA
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
  module_state* st = mfsdp_module_state(module);
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
  module_state* st = mfsdp_module_state(module);
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
  if (stt != MFSDP_OK) return mfsdp_raise(mfsdp_module_state(module), stt);
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
  if (stt != MFSDP_OK) return mfsdp_raise(mfsdp_module_state(module), stt);
  Py_RETURN_NONE;
}

static PyObject* py_cuda_scale(PyObject* module, PyObject* args) {
  PyObject* x;
  double alpha;
  tensor_view v, unused;
  void* ctx;
  if (!PyArg_ParseTuple(args, "Od:cuda_scale_", &x, &alpha) || cuda_pair(module, x, x, &v, &unused, &ctx) < 0)
    return NULL;
  mfsdp_status stt = mfsdp_cuda_kernels->scale(ctx, v.data, v.dtype, v.numel, alpha);
  if (stt != MFSDP_OK) return mfsdp_raise(mfsdp_module_state(module), stt);
  Py_RETURN_NONE;
}

static PyMethodDef cuda_kernel_methods[] = {
    {"cuda_copy_", py_cuda_copy, METH_VARARGS, "cuda_copy_(dst, src, alpha=1.0): the CUDA cast-copy kernel."},
    {"cuda_accumulate_", py_cuda_accumulate, METH_VARARGS,
     "cuda_accumulate_(dst, src, alpha=1.0): the CUDA accumulate kernel."},
    {"cuda_scale_", py_cuda_scale, METH_VARARGS, "cuda_scale_(x, alpha): x *= alpha, the CUDA scale kernel."},
    {"cuda_pack_", py_cuda_pack, METH_VARARGS,
     "cuda_pack_(dst, srcs, offsets, alpha=1.0, accumulate=False): the one-launch bucket pack."},
    {NULL, NULL, 0, NULL},
};
#endif

/* ------------------------------------------------------------------------------------------ */
/* Quantized wires ([Note: quantized wire format] in core/mfsdp_quant.h), on either device: the
 * kernel table of the tensors' device (the CUDA one on torch's current stream, in CUDA builds). */

static int wire_pair(module_state* st, PyObject* wire, PyObject* values, int mode, long long block, const char* what,
                     tensor_view* w, tensor_view* v, const mfsdp_kernel_ops** ops, void** ctx) {
  if (mfsdp_tensor_view(st, wire, what, w) < 0 || mfsdp_tensor_view(st, values, what, v) < 0) return -1;
  int64_t bytes = mfsdp_quant_wire_bytes(mode, v->numel, block);
  if (w->dtype != MFSDP_U8 || bytes < 0 || w->numel < bytes || w->device != v->device) {
    PyErr_Format(PyExc_ValueError, "%s: the wire must be a uint8 tensor of at least quant_wire_bytes(mode, n, block) "
                 "bytes on the values' device (mode %d, %lld values, block %lld: %lld bytes)", what, mode,
                 (long long)v->numel, block, (long long)bytes);
    return -1;
  }
  *ops = &mfsdp_cpu_kernels;
  *ctx = NULL;
  if (v->device < 0) return 0;
#ifdef MFSDP_WITH_CUDA
  *ops = mfsdp_cuda_kernels;
  return current_stream_context(st, v->device, ctx);
#else
  PyErr_Format(PyExc_ValueError, "%s: CUDA tensors need a CUDA build of megatron_fsdp_c", what);
  return -1;
#endif
}

static PyObject* py_quantize(PyObject* module, PyObject* args) {
  module_state* st = mfsdp_module_state(module);
  PyObject *wire, *src;
  int mode;
  long long block;
  tensor_view w, v;
  const mfsdp_kernel_ops* ops;
  void* ctx;
  if (!PyArg_ParseTuple(args, "OOiL:quantize_", &wire, &src, &mode, &block) ||
      wire_pair(st, wire, src, mode, block, "quantize_", &w, &v, &ops, &ctx) < 0)
    return NULL;
  return kernel_result(st, ops->quantize(ctx, w.data, mode, block, v.data, v.dtype, v.numel, 1));
}

static PyObject* py_dequantize(PyObject* module, PyObject* args) {
  module_state* st = mfsdp_module_state(module);
  PyObject *dst, *wire;
  int mode, accumulate = 0;
  long long block;
  double alpha = 1.0;
  tensor_view w, v;
  const mfsdp_kernel_ops* ops;
  void* ctx;
  if (!PyArg_ParseTuple(args, "OOiL|dp:dequantize_", &dst, &wire, &mode, &block, &alpha, &accumulate) ||
      wire_pair(st, wire, dst, mode, block, "dequantize_", &w, &v, &ops, &ctx) < 0)
    return NULL;
  return kernel_result(st, ops->dequantize(ctx, v.data, v.dtype, w.data, mode, block, v.numel, alpha, accumulate));
}

static PyMethodDef wire_kernel_methods[] = {
    {"quantize_", py_quantize, METH_VARARGS,
     "quantize_(wire, src, mode, block): src into one piece of the quantized wire format (uint8 wire; either "
     "device)."},
    {"dequantize_", py_dequantize, METH_VARARGS,
     "dequantize_(dst, wire, mode, block, alpha=1.0, accumulate=False): one piece back into dst (either device)."},
    {NULL, NULL, 0, NULL},
};

int mfsdp_register_kernels(PyObject* module, module_state* st) {
  (void)st;
  if (PyModule_AddFunctions(module, cpu_kernel_methods) < 0 || PyModule_AddFunctions(module, wire_kernel_methods) < 0)
    return -1;
#ifdef MFSDP_WITH_CUDA
  if (PyModule_AddFunctions(module, cuda_kernel_methods) < 0) return -1;
#endif
  return 0;
}
