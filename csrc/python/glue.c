/* glue.c: the floor of megatron_fsdp_c._C (see glue.h): module state, status <-> Python
 * exception, tensor access, dtype codes, torch's current CUDA stream. */
#include "glue.h"

#include <string.h>

#ifdef MFSDP_WITH_CUDA
#include "../cuda/mfsdp_cuda.h"
#endif

/* ------------------------------------------------------------------------------------------ */
/* module state */

module_state* mfsdp_module_state(PyObject* module) { return (module_state*)PyModule_GetState(module); }

module_state* mfsdp_type_state(PyTypeObject* type) { return (module_state*)PyType_GetModuleState(type); }

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

int mfsdp_state_init(PyObject* module, module_state* st) {
  st->error = PyErr_NewExceptionWithDoc("megatron_fsdp_c._C.EngineError",
                                        "A failure inside the C engine; the message names the C file and line.",
                                        PyExc_RuntimeError, NULL);
  if (st->error == NULL || PyModule_AddObjectRef(module, "EngineError", st->error) < 0) return -1;
  st->torch = PyImport_ImportModule("torch");
  if (st->torch == NULL) return -1;
  st->tensor_type = PyObject_GetAttrString(st->torch, "Tensor");
  if (st->tensor_type == NULL || build_dtype_tables(st) < 0) return -1;
  static const char* const names[TENSOR_NAME_COUNT] = {"is_contiguous", "dtype", "data_ptr", "numel", "is_cuda",
                                                       "get_device"};
  for (int k = 0; k < TENSOR_NAME_COUNT; ++k)
    if ((st->tensor_names[k] = PyUnicode_InternFromString(names[k])) == NULL) return -1;
  return PyModule_AddObjectRef(module, "DTYPE_CODES", st->dtype_codes);
}

int mfsdp_state_traverse(module_state* st, visitproc visit, void* arg) {
  Py_VISIT(st->error);
  Py_VISIT(st->torch);
  Py_VISIT(st->tensor_type);
  Py_VISIT(st->dtype_codes);
  Py_VISIT(st->dtypes);
  Py_VISIT(st->engine_type);
  Py_VISIT(st->torch_transport_type);
  Py_VISIT(st->nccl_transport_type);
  for (int k = 0; k < TENSOR_NAME_COUNT; ++k) Py_VISIT(st->tensor_names[k]);
  return 0;
}

void mfsdp_state_clear(module_state* st) {
  Py_CLEAR(st->error);
  Py_CLEAR(st->torch);
  Py_CLEAR(st->tensor_type);
  Py_CLEAR(st->dtype_codes);
  Py_CLEAR(st->dtypes);
  Py_CLEAR(st->engine_type);
  Py_CLEAR(st->torch_transport_type);
  Py_CLEAR(st->nccl_transport_type);
  for (int k = 0; k < TENSOR_NAME_COUNT; ++k) Py_CLEAR(st->tensor_names[k]);
}

/* ------------------------------------------------------------------------------------------ */
/* status <-> Python exception */

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

/* ------------------------------------------------------------------------------------------ */
/* tensors and dtypes */

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

static int get_long(PyObject* obj, PyObject* method, long long* out) {
  PyObject* r = PyObject_CallMethodNoArgs(obj, method);
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
  PyObject* const* name = st->tensor_names;
  PyObject* contiguous = PyObject_CallMethodNoArgs(t, name[TENSOR_IS_CONTIGUOUS]);
  if (contiguous == NULL) return -1;
  int ok = PyObject_IsTrue(contiguous);
  Py_DECREF(contiguous);
  if (ok <= 0) {
    if (ok == 0) PyErr_Format(PyExc_ValueError, "%s: tensor must be contiguous (call .contiguous())", what);
    return -1;
  }
  PyObject* dtype = PyObject_GetAttr(t, name[TENSOR_DTYPE]);
  if (dtype == NULL) return -1;
  int code = mfsdp_dtype_code(st, dtype, what);
  Py_DECREF(dtype);
  if (code < 0) return -1;
  long long ptr, numel, device = -1;
  if (get_long(t, name[TENSOR_DATA_PTR], &ptr) < 0 || get_long(t, name[TENSOR_NUMEL], &numel) < 0) return -1;
  PyObject* is_cuda = PyObject_GetAttr(t, name[TENSOR_IS_CUDA]);
  if (is_cuda == NULL) return -1;
  int cuda = PyObject_IsTrue(is_cuda);
  Py_DECREF(is_cuda);
  if (cuda < 0) return -1;
  if (cuda && get_long(t, name[TENSOR_GET_DEVICE], &device) < 0) return -1;
  out->data = (void*)(intptr_t)ptr;
  out->dtype = code;
  out->numel = numel;
  out->device = (int32_t)device;
  return 0;
}

int mfsdp_tensor_data_ptr(module_state* st, PyObject* t, void** data) {
  long long ptr;
  if (get_long(t, st->tensor_names[TENSOR_DATA_PTR], &ptr) < 0) return -1;
  *data = (void*)(intptr_t)ptr;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* torch's current CUDA stream */

#ifdef MFSDP_WITH_CUDA
int mfsdp_use_current_stream(PyObject* current_stream, int device, void* kernels_ctx) {
  PyObject* stream = PyObject_CallFunction(current_stream, "i", device);
  PyObject* handle = stream ? PyObject_GetAttrString(stream, "cuda_stream") : NULL;
  Py_XDECREF(stream);
  if (handle == NULL) return -1;
  mfsdp_cuda_set_stream(kernels_ctx, (void*)(intptr_t)PyLong_AsLongLong(handle));
  Py_DECREF(handle);
  return PyErr_Occurred() ? -1 : 0;
}
#endif
