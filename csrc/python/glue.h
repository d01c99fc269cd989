/* glue.h: shared pieces of the CPython module megatron_fsdp_c._C.
 *
 * The module is multi-phase initialised and keeps everything it needs in its module state
 * (no global PyObject*). Heap types find that state through PyType_GetModuleByDef. */
#ifndef MFSDP_GLUE_H
#define MFSDP_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../comm/mfsdp_pipeline.h"
#include "../core/mfsdp_dtype.h"
#include "../core/mfsdp_layout.h"

typedef struct module_state {
  PyObject* error;           /* megatron_fsdp_c._C.EngineError */
  PyObject* torch;           /* the torch module */
  PyObject* tensor_type;     /* torch.Tensor */
  PyObject* dtype_codes;     /* dict torch.dtype -> mfsdp_dtype code */
  PyObject* dtypes;          /* tuple code -> torch.dtype */
  PyTypeObject* engine_type;
  PyTypeObject* torch_transport_type;
  PyTypeObject* nccl_transport_type; /* NULL when built without CUDA */
} module_state;

extern PyModuleDef mfsdp_module_def;

module_state* mfsdp_state_of_type(PyTypeObject* type);

/* Transport objects share this head, so the engine can take any of them. */
typedef struct transport_object {
  PyObject_HEAD
  const mfsdp_transport_ops* ops;
  void* ctx;
  int device; /* -1: host buffers, >= 0: CUDA device of the buffers it moves */
} transport_object;

/* Raises the exception for `status` (using the last-error text) and returns NULL. */
PyObject* mfsdp_raise(module_state* st, mfsdp_status status);

/* Records the pending Python exception as the engine's last error and clears it. */
mfsdp_status mfsdp_status_from_python(mfsdp_status status, const char* what);

/* A contiguous tensor's address, dtype code, element count and device (-1: CPU). */
typedef struct tensor_view {
  void* data;
  int32_t dtype;
  int64_t numel;
  int32_t device;
} tensor_view;
int mfsdp_tensor_view(module_state* st, PyObject* tensor, const char* what, tensor_view* out);
int mfsdp_dtype_code(module_state* st, PyObject* dtype, const char* what); /* -1 with exception */

/* The torch memory ops: buffers are torch tensors on one device (see mfsdp_transport.h). */
typedef struct torch_memory {
  module_state* st;
  PyObject* device; /* torch.device */
  int device_index; /* -1 for CPU */
} torch_memory;
extern const mfsdp_memory_ops mfsdp_torch_memory_ops;

int mfsdp_register_torch_transport(PyObject* module, module_state* st);
int mfsdp_register_engine(PyObject* module, module_state* st);
int mfsdp_register_nccl(PyObject* module, module_state* st); /* no-op without CUDA */
#ifdef MFSDP_WITH_CUDA
/* Points a CUDA kernel context at torch's current stream on `device`; current_stream is
 * torch.cuda.current_stream. 0, or -1 with an exception. (cuda_glue.c) */
int mfsdp_use_current_stream(PyObject* current_stream, int device, void* kernels_ctx);
#endif

#endif
