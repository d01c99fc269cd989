/* mfsdp_status.h: status codes and the last-error text of the C engine.
 *
 * Every engine function returns an mfsdp_status. On failure it also records a message
 * "file:line: function: text" in thread-local storage; the Python glue turns the pair into
 * one exception (mfsdp_raise in csrc/python/glue.c), so no C path ever aborts the interpreter.
 * The first error wins: MFSDP_CHECK* propagate a status without overwriting its text. */
#ifndef MFSDP_STATUS_H
#define MFSDP_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mfsdp_status {
  MFSDP_OK = 0,
  MFSDP_ERR_INVALID_ARGUMENT = 1, /* caller passed something inconsistent */
  MFSDP_ERR_INVALID_STATE = 2,    /* call not allowed in the current bucket state */
  MFSDP_ERR_OUT_OF_MEMORY = 3,
  MFSDP_ERR_UNSUPPORTED = 4,      /* dtype or operation this build cannot do */
  MFSDP_ERR_COMM = 5,             /* a collective failed */
  MFSDP_ERR_TIMEOUT = 6,          /* a collective did not finish in time */
  MFSDP_ERR_CUDA = 7,
  MFSDP_ERR_NCCL = 8,
  MFSDP_ERR_PYTHON = 9            /* a Python exception is already set (glue callbacks) */
} mfsdp_status;

const char* mfsdp_status_name(mfsdp_status status);

/* The message of the most recent failure on this thread ("" if none). */
const char* mfsdp_last_error(void);
void mfsdp_clear_error(void);

/* Records `status` with a formatted message and returns it. Use through MFSDP_FAIL. */
mfsdp_status mfsdp_set_error(mfsdp_status status, const char* file, int line, const char* func,
                             const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

#define MFSDP_FAIL(status, ...) mfsdp_set_error((status), __FILE__, __LINE__, __func__, __VA_ARGS__)

#define MFSDP_CHECK(call)                   \
  do {                                      \
    mfsdp_status mfsdp_s_ = (call);         \
    if (mfsdp_s_ != MFSDP_OK) return mfsdp_s_; \
  } while (0)

#define MFSDP_CHECK_GOTO(call, status, label) \
  do {                                        \
    (status) = (call);                        \
    if ((status) != MFSDP_OK) goto label;     \
  } while (0)

#ifdef __cplusplus
}
#endif
#endif
