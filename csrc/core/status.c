/* status.c: thread-local last-error text (see mfsdp_status.h). */
#include "mfsdp_status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define MFSDP_ERROR_CAPACITY 1024

static _Thread_local char last_error[MFSDP_ERROR_CAPACITY];

const char* mfsdp_status_name(mfsdp_status status) {
  switch (status) {
    case MFSDP_OK: return "ok";
    case MFSDP_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MFSDP_ERR_INVALID_STATE: return "invalid state";
    case MFSDP_ERR_OUT_OF_MEMORY: return "out of memory";
    case MFSDP_ERR_UNSUPPORTED: return "unsupported";
    case MFSDP_ERR_COMM: return "communication error";
    case MFSDP_ERR_TIMEOUT: return "timeout";
    case MFSDP_ERR_CUDA: return "CUDA error";
    case MFSDP_ERR_NCCL: return "NCCL error";
    case MFSDP_ERR_PYTHON: return "Python error";
  }
  return "unknown status";
}

const char* mfsdp_last_error(void) { return last_error; }

void mfsdp_clear_error(void) { last_error[0] = '\0'; }

mfsdp_status mfsdp_set_error(mfsdp_status status, const char* file, int line, const char* func,
                             const char* fmt, ...) {
  const char* base = strrchr(file, '/');
  int used = snprintf(last_error, sizeof last_error, "%s:%d: %s: ", base ? base + 1 : file, line, func);
  if (used < 0 || (size_t)used >= sizeof last_error) return status;
  va_list args;
  va_start(args, fmt);
  vsnprintf(last_error + used, sizeof last_error - (size_t)used, fmt, args);
  va_end(args);
  return status;
}
