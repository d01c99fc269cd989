/* mfsdp_adam.h: the fused Adam/AdamW step over host memory (adam_cpu.c).
 *
 * [Note: fused Adam]
 * One pass over each element does all of torch.optim.Adam's single-tensor step (AdamW is Adam
 * with decoupled weight decay), in its order and at its precision (T: the parameter's dtype,
 * float32 or float64; every scalar is rounded to T first, as torch's scalar ops do):
 *   g  = grad (as T; -grad with maximize)
 *   p  = p * (1 - lr*wd)                       decoupled weight decay (AdamW)
 *   g  = fma(p, wd, g)                         coupled weight decay (Adam), as torch's vectorised add
 *   m  = fma(w, g - m, m)   (w = 1-beta1 < .5) torch's vectorised lerp; else fma(w - 1, g - m, g)
 *   v  = fma((1-beta2)*g, g, v*beta2)          mul_, then addcmul_ as torch's vector lanes fuse it
 *   vm = max(vm, v), used for v below          amsgrad
 *   p  = p + ((-lr/bc1)*m) / (sqrt(v)/sqrt(bc2) + eps)
 * with bc1 = 1 - beta1^step and bc2 = 1 - beta2^step computed in double, as Python does. So a
 * step gives torch's moments bit for bit; the parameter can differ in the last bit of the
 * denominator only, because torch's CPU sqrt is MKL's (measured on torch 2.13: not correctly
 * rounded for 20% of float32 and 1.4% of float64 inputs) and ours is IEEE's sqrt; torch's
 * scalar tails (its last < 8 elements) also multiply and add apart where its vector lanes fuse.
 * The same element gives the same bits at any thread count and on any SIMD path: the paths
 * differ in width only, never in operations (C compiled with -ffp-contract=off; fma() where
 * torch fuses).
 *
 * A step may also write a bf16/fp16 copy of the updated parameter (`compute`, rounded to nearest
 * even as every cast of the engine), so a main-weights update and its compute-weights cast are
 * one pass over memory. Gradients may be bf16/fp16 with float32 parameters (read upcast). */
#ifndef MFSDP_ADAM_H
#define MFSDP_ADAM_H

#include <stdint.h>

#include "mfsdp_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One parameter group's hyperparameters. */
typedef struct mfsdp_adam_config {
  double lr, beta1, beta2, eps, weight_decay;
  int32_t amsgrad;   /* keep max(v) and divide by it */
  int32_t maximize;  /* ascend: the gradient's sign flipped */
  int32_t decoupled; /* AdamW's weight decay (else Adam's L2 term in the gradient) */
} mfsdp_adam_config;

/* One tensor of a step: n elements each. exp_avg, exp_avg_sq and max_exp_avg_sq (amsgrad only,
 * else NULL) are of the parameter's dtype, as torch keeps them. */
typedef struct mfsdp_adam_tensor {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;
  void* compute;        /* NULL, or where the updated parameter is written as compute_dtype */
  int64_t n;
  int64_t step;         /* this step's count (>= 1): the bias corrections' exponent */
  int32_t param_dtype;  /* MFSDP_F32 or MFSDP_F64 */
  int32_t grad_dtype;   /* param_dtype, or BF16/F16 with F32 parameters */
  int32_t compute_dtype;/* BF16, F16 or F32 (with F32 params), when compute is set */
} mfsdp_adam_tensor;

/* Steps every tensor, on `threads` threads (<= 1: this one). Tensors must not overlap. */
mfsdp_status mfsdp_adam_step(const mfsdp_adam_config* cfg, const mfsdp_adam_tensor* tensors, int32_t n_tensors,
                             int32_t threads);

/* The SIMD path this CPU runs: "avx512", "avx2" or "portable" (chosen once, at the first step;
 * the environment variable MFSDP_ADAM_ISA=portable or =avx2 caps it, for tests). */
const char* mfsdp_adam_isa(void);

#ifdef __cplusplus
}
#endif
#endif
