/* torch_memory.h: the torch memory ops (torch_memory.c): the engine's buffers are torch tensors
 * on one device (see mfsdp_transport.h for the ops' contract). */
#ifndef MFSDP_TORCH_MEMORY_H
#define MFSDP_TORCH_MEMORY_H

#include "glue.h"

/* The ops' context; the engine owns it. `device` is borrowed from the engine, which keeps a
 * reference for as long as its pipeline (and so these ops) live. */
typedef struct torch_memory {
  module_state* st;
  PyObject* device; /* torch.device */
  int device_index; /* -1 for CPU */
  int pin_host;     /* host buffers in pinned memory (torch.zeros(pin_memory=True)) */
} torch_memory;

extern const mfsdp_memory_ops mfsdp_torch_memory_ops;

/* Fills *m for buffers on `device` (a torch.device, borrowed as above); a CUDA device needs an
 * index. 0, or -1 with an exception. */
int mfsdp_torch_memory_init(torch_memory* m, module_state* st, PyObject* device);

/* Fills *m for the host buffers of offloaded buckets ([Note: offloaded buckets] in
 * csrc/comm/buffers.c): CPU tensors, pinned when `pin_host` (`cpu` is torch.device('cpu'), borrowed
 * as above). */
void mfsdp_torch_host_memory_init(torch_memory* m, module_state* st, PyObject* cpu, int pin_host);

#endif
