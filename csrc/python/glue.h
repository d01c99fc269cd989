/* glue.h: the floor of the CPython module megatron_fsdp_c._C (glue.c): what every other file of
 * csrc/python/ uses, and nothing that knows them.
 *
 * Files include only the headers of files below them:
 *   glue.h          (glue.c)          <- every file
 *   torch_memory.h  (torch_memory.c)  <- engine.c
 *   bucket_spec.h   (bucket_spec.c)   <- engine.c
 *   pieces.h        (register fns)    <- module.c, and each piece for its own prototype
 * The pieces (plan.c, kernels.c, optim.c, host_heap.c, torch_transport.c, nccl_transport_type.c,
 * bucket_spec.c, engine.c) use nothing of each other but those two headers; module.c is the
 * roof and only registers them.
 *
 * The module is multi-phase initialised and keeps everything it needs in its module state (no
 * global PyObject*), as CPython's Modules/xxlimited.c does. Functions get the state from their
 * module (mfsdp_module_state); methods of our heap types from their type (mfsdp_type_state). */
#ifndef MFSDP_GLUE_H
#define MFSDP_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../comm/mfsdp_pipeline.h"
#include "../core/mfsdp_dtype.h"
#include "../core/mfsdp_layout.h"

/* The tensor attributes mfsdp_tensor_view reads, as interned names made once (a name built at
 * each call cost a third of a view: the fused step and grad_ready read hundreds per step). */
enum { TENSOR_IS_CONTIGUOUS, TENSOR_DTYPE, TENSOR_DATA_PTR, TENSOR_NUMEL, TENSOR_IS_CUDA, TENSOR_GET_DEVICE,
       TENSOR_NAME_COUNT };

typedef struct module_state {
  PyObject* error;           /* megatron_fsdp_c._C.EngineError */
  PyObject* tensor_names[TENSOR_NAME_COUNT];
  PyObject* torch;           /* the torch module */
  PyObject* tensor_type;     /* torch.Tensor */
  PyObject* dtype_codes;     /* dict torch.dtype -> mfsdp_dtype code */
  PyObject* dtypes;          /* tuple code -> torch.dtype */
  PyTypeObject* engine_type;
  PyTypeObject* torch_transport_type;
  PyTypeObject* nccl_transport_type; /* NULL when built without CUDA */
} module_state;

/* The state of our module: of `module` itself, or of the module that made a heap type. Our
 * types are not subclassable (no Py_TPFLAGS_BASETYPE), so Py_TYPE(self) is always the type
 * PyType_FromModuleAndSpec made and PyType_GetModuleState finds its module directly (a
 * subclassable type would need PyType_GetModuleByDef, which walks the MRO). */
module_state* mfsdp_module_state(PyObject* module);
module_state* mfsdp_type_state(PyTypeObject* type);

/* Fills the floor's part of the state (EngineError, torch, torch.Tensor, the dtype tables) and
 * adds EngineError and DTYPE_CODES to the module; 0, or -1 with an exception. The pieces fill
 * their own type slots. Traverse and clear cover every slot. */
int mfsdp_state_init(PyObject* module, module_state* st);
int mfsdp_state_traverse(module_state* st, visitproc visit, void* arg);
void mfsdp_state_clear(module_state* st);

/* Transport objects share this head, so the engine can take any of them. */
typedef struct transport_object {
  PyObject_HEAD
  const mfsdp_transport_ops* ops;
  void* ctx;
  int device; /* -1: host buffers, >= 0: CUDA device of the buffers it moves */
} transport_object;

/* The one place a C status becomes a Python exception: raises the exception for `status` with
 * the last-error text ("file:line: function: text", see mfsdp_status.h) and returns NULL.
 * MFSDP_ERR_PYTHON with an exception already set keeps that exception. */
PyObject* mfsdp_raise(module_state* st, mfsdp_status status);

/* The other way round, for C callbacks that call Python: records the pending Python exception
 * as the engine's last error, clears it, and returns `status` (MFSDP_ERR_TIMEOUT when the
 * exception says it timed out). */
mfsdp_status mfsdp_status_from_python(mfsdp_status status, const char* what);

/* A contiguous tensor's address, dtype code, element count and device (-1: CPU). */
typedef struct tensor_view {
  void* data;
  int32_t dtype;
  int64_t numel;
  int32_t device;
} tensor_view;
int mfsdp_tensor_view(module_state* st, PyObject* tensor, const char* what, tensor_view* out);
/* Only the data pointer of a tensor mfsdp_tensor_view accepted (one call: a re-check). 0 on success. */
int mfsdp_tensor_data_ptr(module_state* st, PyObject* tensor, void** data);
int mfsdp_dtype_code(module_state* st, PyObject* dtype, const char* what); /* -1 with exception */

#ifdef MFSDP_WITH_CUDA
/* Points a CUDA kernel context at torch's current stream on `device`; current_stream is
 * torch.cuda.current_stream. 0, or -1 with an exception. */
int mfsdp_use_current_stream(PyObject* current_stream, int device, void* kernels_ctx);
#endif

#endif
