/* bucket_spec.h: the Engine's bucket specs from Python (bucket_spec.c): each a dict as _C.plan
 * makes it, plus the dtypes and modes the wrapper adds (see mfsdp_bucket_spec). */
#ifndef MFSDP_BUCKET_SPEC_H
#define MFSDP_BUCKET_SPEC_H

#include "glue.h"

/* Parses a sequence of bucket dicts into *out, n_out of them (the caller frees them with
 * mfsdp_free_bucket_specs); 0, or -1 with an exception and nothing to free. */
int mfsdp_bucket_specs_from_python(PyObject* seq, mfsdp_bucket_spec** out, int32_t* n_out);
void mfsdp_free_bucket_specs(mfsdp_bucket_spec* specs, int32_t n);

#endif
