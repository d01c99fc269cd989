/* fault_trace.c: native_fault_trace, the native stack of the thread a fatal signal hits, printed
 * before Python's faulthandler prints the Python ones ([Note: native fault trace]). Process-wide,
 * like the signal handlers. */
#include "pieces.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <execinfo.h>
#include <sys/syscall.h>
#endif

/* [Note: native fault trace]
 * faulthandler prints every Python thread's stack on SIGSEGV/SIGABRT/SIGBUS/SIGFPE/SIGILL, and
 * marks the one that faulted "Current thread". A fault in a thread that runs no Python (gloo's
 * workers, autograd's device threads, the engine's and the optimizer's C threads) shows no
 * "Current thread" at all: the rank died, and nothing says where. native_fault_trace() installs a
 * handler in front of the current ones (faulthandler's, ASan's) that writes the faulting thread's
 * native frames to fd 2 -- glibc's backtrace_symbols_fd: the shared object, the nearest exported
 * symbol and the offset, which addr2line or gdb turn into a line -- between two marker lines, then
 * puts the previous handler back and raises the signal again, so faulthandler and the default
 * action (the exit status, a core) follow as before. Async-signal-safe apart from backtrace()'s
 * first call, which loads libgcc's unwinder: made once at install. Not on by default: for the test
 * grids' ranks and the stress harness (tests/support/spawns.py, benchmarks/stress.py). */
#if defined(__GLIBC__)
static const int kSignals[] = {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL};
#define N_SIGNALS ((int)(sizeof(kSignals) / sizeof(kSignals[0])))
static struct sigaction g_previous[N_SIGNALS];
static volatile sig_atomic_t g_installed;

static void put(const char* s) {
  ssize_t r = write(2, s, strlen(s));
  (void)r;
}

static void put_int(long v) {
  char buf[24];
  int i = (int)sizeof(buf);
  buf[--i] = '\0';
  int negative = v < 0;
  unsigned long u = negative ? (unsigned long)(-v) : (unsigned long)v;
  do {
    buf[--i] = (char)('0' + u % 10);
    u /= 10;
  } while (u && i > 1);
  if (negative && i > 0) buf[--i] = '-';
  put(buf + i);
}

static void on_fatal(int sig, siginfo_t* info, void* context) {
  (void)info;
  (void)context;
  void* frames[64];
  int n = backtrace(frames, 64);
  put("megatron_fsdp_c: native stack of thread ");
  put_int((long)syscall(SYS_gettid));
  put(" (signal ");
  put_int(sig);
  put(", innermost first):\n");
  backtrace_symbols_fd(frames, n, 2);
  put("megatron_fsdp_c: end of the native stack\n");
  for (int i = 0; i < N_SIGNALS; i++) {
    if (kSignals[i] == sig) sigaction(sig, &g_previous[i], NULL);
  }
  raise(sig); /* the previous handler (faulthandler's) runs when this handler returns */
}
#endif

static PyObject* py_native_fault_trace(PyObject* module, PyObject* unused) {
  (void)module;
  (void)unused;
#if defined(__GLIBC__)
  if (g_installed) return PyLong_FromLong(1);
  void* warm[1];
  (void)backtrace(warm, 1); /* loads the unwinder now, not inside a signal handler */
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < N_SIGNALS; i++) {
    if (sigaction(kSignals[i], &sa, &g_previous[i]) != 0) return PyErr_SetFromErrno(PyExc_OSError);
  }
  g_installed = 1;
  return PyLong_FromLong(1);
#else
  return PyLong_FromLong(-1);
#endif
}

static PyMethodDef fault_trace_methods[] = {
    {"native_fault_trace", py_native_fault_trace, METH_NOARGS,
     "native_fault_trace() -> 1: on a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) the faulting "
     "thread's native stack goes to stderr first, then the handlers installed before this call run "
     "(faulthandler's: call faulthandler.enable() first); process-wide, once (-1: not glibc). "
     "See [Note: native fault trace]."},
    {NULL, NULL, 0, NULL},
};

int mfsdp_register_fault_trace(PyObject* module, module_state* st) {
  (void)st;
  return PyModule_AddFunctions(module, fault_trace_methods);
}
