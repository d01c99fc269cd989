/* torch_memory.c: the engine's buffers as torch tensors (torch_memory.h).
 *
 * Every storage buffer is one flat torch tensor made once; materialise/release resize its untyped
 * storage (see [Note: storage resize] in csrc/comm/buffers.c). A buffer's handle is its tensor. */
#include "torch_memory.h"

static mfsdp_status py_fail(const char* what) { return mfsdp_status_from_python(MFSDP_ERR_PYTHON, what); }

static mfsdp_status read_data_ptr(PyObject* tensor, void** data) {
  PyObject* r = PyObject_CallMethod(tensor, "data_ptr", NULL);
  if (r == NULL) return py_fail("data_ptr");
  *data = (void*)(intptr_t)PyLong_AsLongLong(r);
  Py_DECREF(r);
  return PyErr_Occurred() ? py_fail("data_ptr") : MFSDP_OK;
}

static mfsdp_status mem_create(void* ctx, int64_t numel, int32_t dtype, mfsdp_buffer* out) {
  torch_memory* m = ctx;
  PyObject* zeros = PyObject_GetAttrString(m->st->torch, "zeros");
  PyObject* args = Py_BuildValue("(L)", (long long)numel);
  PyObject* kwargs = Py_BuildValue("{s:O,s:O,s:O}", "dtype", PyTuple_GET_ITEM(m->st->dtypes, dtype), "device", m->device,
                                   "pin_memory", m->pin_host ? Py_True : Py_False);
  PyObject* t = (zeros && args && kwargs) ? PyObject_Call(zeros, args, kwargs) : NULL;
  Py_XDECREF(zeros);
  Py_XDECREF(args);
  Py_XDECREF(kwargs);
  if (t == NULL) return mfsdp_status_from_python(MFSDP_ERR_OUT_OF_MEMORY, "create buffer");
  *out = (mfsdp_buffer){NULL, numel, dtype, m->device_index, t};
  mfsdp_status s = read_data_ptr(t, &out->data);
  if (s != MFSDP_OK) Py_CLEAR(out->handle);
  return s;
}

static mfsdp_status mem_create_view(void* ctx, const mfsdp_buffer* storage, int64_t offset, int64_t numel,
                                    mfsdp_buffer* out) {
  (void)ctx;
  PyObject* t = PyObject_CallMethod((PyObject*)storage->handle, "narrow", "iLL", 0, (long long)offset, (long long)numel);
  if (t == NULL) return py_fail("create view");
  *out = (mfsdp_buffer){NULL, numel, storage->dtype, storage->device, t};
  return MFSDP_OK;
}

static mfsdp_status resize_storage(mfsdp_buffer* b, int64_t nbytes) {
  PyObject* storage = PyObject_CallMethod((PyObject*)b->handle, "untyped_storage", NULL);
  if (storage == NULL) return py_fail("untyped_storage");
  PyObject* r = PyObject_CallMethod(storage, "resize_", "L", (long long)nbytes);
  Py_DECREF(storage);
  if (r == NULL) return mfsdp_status_from_python(nbytes ? MFSDP_ERR_OUT_OF_MEMORY : MFSDP_ERR_PYTHON, "resize_");
  Py_DECREF(r);
  return MFSDP_OK;
}

static mfsdp_status mem_materialize(void* ctx, mfsdp_buffer* b) {
  (void)ctx;
  MFSDP_CHECK(resize_storage(b, b->numel * mfsdp_dtype_size(b->dtype)));
  return read_data_ptr((PyObject*)b->handle, &b->data);
}

static mfsdp_status mem_release(void* ctx, mfsdp_buffer* b) {
  (void)ctx;
  MFSDP_CHECK(resize_storage(b, 0));
  b->data = NULL;
  return MFSDP_OK;
}

static void mem_destroy(void* ctx, mfsdp_buffer* b) {
  (void)ctx;
  PyObject* t = (PyObject*)b->handle;
  b->handle = NULL;
  b->data = NULL;
  Py_XDECREF(t);
}

static void mem_retain(void* ctx, void* handle) {
  (void)ctx;
  Py_XINCREF((PyObject*)handle);
}

static void mem_drop(void* ctx, void* handle) {
  (void)ctx;
  Py_XDECREF((PyObject*)handle);
}

const mfsdp_memory_ops mfsdp_torch_memory_ops = {mem_create, mem_create_view, mem_materialize, mem_release,
                                                 mem_destroy, mem_retain,      mem_drop};

int mfsdp_torch_memory_init(torch_memory* m, module_state* st, PyObject* device) {
  PyObject* index = PyObject_GetAttrString(device, "index");
  PyObject* type = PyObject_GetAttrString(device, "type");
  if (index == NULL || type == NULL) {
    Py_XDECREF(index);
    Py_XDECREF(type);
    return -1;
  }
  int is_cuda = PyUnicode_Check(type) && PyUnicode_CompareWithASCIIString(type, "cuda") == 0;
  /* "cuda" without an index would mean whichever device is current at each call: refuse it
   * rather than guess (fully_shard resolves it once, to the current device). */
  int device_index = is_cuda && index != Py_None ? (int)PyLong_AsLong(index) : -1;
  Py_DECREF(index);
  Py_DECREF(type);
  if (PyErr_Occurred()) return -1;
  if (is_cuda && device_index < 0) {
    PyErr_SetString(PyExc_ValueError, "Engine: a CUDA device needs an index (torch.device('cuda', N))");
    return -1;
  }
  *m = (torch_memory){st, device, device_index, 0};
  return 0;
}

void mfsdp_torch_host_memory_init(torch_memory* m, module_state* st, PyObject* cpu, int pin_host) {
  *m = (torch_memory){st, cpu, -1, pin_host};
}
