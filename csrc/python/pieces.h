/* pieces.h: what each file of csrc/python/ adds to megatron_fsdp_c._C. module.c's exec slot calls
 * these after mfsdp_state_init (glue.c), in this order; each returns 0, or -1 with an exception.
 * A piece that makes a type stores it in its slot of the module state. */
#ifndef MFSDP_PIECES_H
#define MFSDP_PIECES_H

#include "glue.h"

int mfsdp_register_plan(PyObject* module, module_state* st);            /* plan.c: _C.plan */
int mfsdp_register_kernels(PyObject* module, module_state* st);         /* kernels.c: copy_, cuda_pack_, ... */
int mfsdp_register_optim(PyObject* module, module_state* st);           /* optim.c: adam_step_, adam_isa */
int mfsdp_register_host_heap(PyObject* module, module_state* st);       /* host_heap.c: keep/trim_host_heap */
int mfsdp_register_fault_trace(PyObject* module, module_state* st);     /* fault_trace.c: native_fault_trace */
int mfsdp_register_torch_transport(PyObject* module, module_state* st); /* torch_transport.c: TorchTransport */
int mfsdp_register_nccl_transport(PyObject* module, module_state* st);  /* nccl_transport_type.c (no-op without CUDA) */
int mfsdp_register_bucket_spec(PyObject* module, module_state* st);     /* bucket_spec.c: GRAD_*, BUF_* */
int mfsdp_register_engine(PyObject* module, module_state* st);          /* engine.c: Engine */

#endif
