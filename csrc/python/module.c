/* module.c: the module megatron_fsdp_c._C itself, the roof of csrc/python/: its definition and
 * multi-phase init, which fills the module state (glue.c) and registers each piece (pieces.h).
 * Nothing else lives here. */
#include "pieces.h"

static int module_exec(PyObject* module) {
  module_state* st = mfsdp_module_state(module);
  if (mfsdp_state_init(module, st) < 0) return -1;
  if (mfsdp_register_plan(module, st) < 0 || mfsdp_register_kernels(module, st) < 0 ||
      mfsdp_register_optim(module, st) < 0 || mfsdp_register_host_heap(module, st) < 0 ||
      mfsdp_register_fault_trace(module, st) < 0 || mfsdp_register_torch_transport(module, st) < 0 ||
      mfsdp_register_nccl_transport(module, st) < 0 || mfsdp_register_bucket_spec(module, st) < 0 ||
      mfsdp_register_engine(module, st) < 0)
    return -1;
  return 0;
}

static int module_traverse(PyObject* module, visitproc visit, void* arg) {
  return mfsdp_state_traverse(mfsdp_module_state(module), visit, arg);
}

static int module_clear(PyObject* module) {
  mfsdp_state_clear(mfsdp_module_state(module));
  return 0;
}

static void module_free(void* module) { module_clear((PyObject*)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc, "The C engine of megatron_fsdp_c: layout planner, kernels and collective pipeline.");

static PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "megatron_fsdp_c._C",
    .m_doc = module_doc,
    .m_size = sizeof(module_state),
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
