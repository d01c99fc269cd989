"""A gloo collective given up on keeps running, and writes into its output when the late peer
arrives: if the output's storage was freed meanwhile (resize_(0), as a released buffer is), the
write lands in freed memory. No megatron_fsdp_c here: torch and gloo alone.

    .venv/bin/python benchmarks/repro/gloo_freed_output.py [numel]

Rank 0 starts an all-gather, waits for it with a 0.5 s timeout (Work.wait raises), frees the
output's storage and allocates a zeroed tensor of the same size; rank 1 joins the all-gather 3 s
late. Measured on 2026-12-06 (torch 2.13.0, CPU, 2 cores): rank 0 dies with SIGSEGV in every run,
in gloo's worker thread (pt_gloo_runloop: ProcessGroupGloo::AsyncWork::execute ->
AsyncAllgatherWork::allgather -> at::native::copy_ into the freed output; the stack was taken with
gdb attached to rank 0), at numel 1,000 and 100,000. That is the shape of the SIGSEGV inside a gloo
all-gather seen once in a full suite (docs/testing.md). What megatron_fsdp_c does about it:
[Note: buffers under a collective] in csrc/comm/buffers.c. Prints the outcome; exits 0 when the
hazard showed (rank 0 killed by a signal, or the fresh tensor written), 1 when it did not."""
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, world, port, numel, verdict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    inp = torch.full((numel,), float(rank + 1))
    out = torch.empty(numel * world)
    if rank == 1:
        time.sleep(3)
    work = dist.all_gather_into_tensor(out, inp, async_op=True)
    if rank == 1:
        work.wait()
        time.sleep(2)
        os._exit(0)
    try:
        work.wait(datetime.timedelta(seconds=0.5))
        raise SystemExit("rank 0: the wait did not time out; nothing shown")
    except RuntimeError as e:
        print(f"rank 0: Work.wait raised {str(e)[:60]!r}; freeing the output under the running all-gather", flush=True)
    del work
    out.untyped_storage().resize_(0)
    victim = torch.zeros(numel * world)
    time.sleep(5)  # rank 1 joins meanwhile
    written = int((victim != 0).sum())
    with open(verdict, "w") as f:
        f.write(str(written))
    os._exit(0)


def main():
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    verdict = f"/tmp/gloo_freed_output.{os.getpid()}"
    try:
        mp.spawn(rank_main, args=(2, port, numel, verdict), nprocs=2)
    except mp.ProcessExitedException as e:
        print(f"hazard shown: {e} (the abandoned all-gather wrote into the freed output)")
        return 0
    written = int(open(verdict).read())
    os.unlink(verdict)
    if written:
        print(f"hazard shown: {written} of {numel * 2} elements of a freshly zeroed tensor were written by the "
              "abandoned all-gather")
        return 0
    print("not shown this run: the freed memory was neither unmapped nor reused")
    return 1


if __name__ == "__main__":
    sys.exit(main())
