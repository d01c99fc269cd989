"""Loaded at start-up by every Python process of a torch-suite run (the harness puts this folder
first on PYTHONPATH), so the rank processes torch's MultiProcessTestCase spawns and the child
interpreters some tests start get the same set-up as the test process itself. It does nothing
unless the harness set MFSDP_TORCH_SUITE_IMPL.

[Note: torch-suite set-up]
Identical for --impl torch and --impl ours (so a difference between the two columns is ours):
- CPU as an N-device machine (N = MFSDP_TORCH_SUITE_DEVICES): torch.cpu.device_count() and
  common_fsdp.DEVICE_COUNT return N, so the world sizes the tests derive from the device count
  are those of an N-GPU machine; skip_if_lt_x_gpu(x) runs a test when x <= N or the file says
  allow_cpu=True, and skips it otherwise (torch 2.13 skips every test without allow_cpu=True
  on CPU).
- FSDPTest forks its rank processes (MFSDP_TORCH_SUITE_START=spawn keeps torch's spawn): a
  spawned rank re-imports torch and the test file, ~20 s a rank on a loaded two-core machine.
- FSDPTest._run is FSDPTestMixin._run (the same body with the CPU guard), and
  FSDPTestContinuous._init_pg drops its device-count check: both exit with "skip" whenever
  torch.accelerator.device_count() (0 on CPU) < world size.
Only for --impl ours, megatron_fsdp_c.per_module's fully_shard, FSDPModule and UnshardHandle
replace torch's in every module the test files import them from (SWAP_SITES), before any test
module is imported: what a user switching an FSDP2 script by its imports gets. Nothing else of
torch is swapped (register_fsdp_forward_method, fully_shard.state, the FSDPParamGroup internals
stay torch's), so a test reading those fails on ours and is triaged as such.
"""
import os

IMPL = os.environ.get("MFSDP_TORCH_SUITE_IMPL")

# Where torch 2.13 defines or re-exports the names a test file may import them from.
SWAP_SITES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.testing._internal.common_fsdp",  # MLPStack.parallelize and compiled_fsdp_test call it
)
SWAPPED_NAMES = ("fully_shard", "FSDPModule", "UnshardHandle")


def _emulate_devices(count: int) -> None:
    import torch
    import torch.testing._internal.common_distributed as common_distributed
    import torch.testing._internal.common_fsdp as common_fsdp

    torch.cpu.device_count = lambda: count
    common_fsdp.DEVICE_COUNT = count
    orig_skip = common_distributed.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x, *, allow_cpu=False):
        # The file's allow_cpu=True stands (upstream runs it on CPU); otherwise run it as
        # an N-GPU machine would: when it needs no more devices than we emulate.
        return orig_skip(x, allow_cpu=allow_cpu or x <= count)

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    common_fsdp.skip_if_lt_x_gpu = skip_if_lt_x_gpu

    # _run is a classmethod: take the function, or it stays bound to the mixin.
    common_fsdp.FSDPTest._run = classmethod(vars(common_fsdp.FSDPTestMixin)["_run"].__func__)
    if os.environ.get("MFSDP_TORCH_SUITE_START", "fork") == "fork":
        import torch.multiprocessing

        def _fork_processes(self):
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

        common_fsdp.FSDPTest._spawn_processes = _fork_processes
    continuous = getattr(common_fsdp, "FSDPTestContinuous", None)
    if continuous is not None:
        base_init_pg = common_distributed.MultiProcContinuousTest._init_pg.__func__

        @classmethod
        def _init_pg(cls, rank, world_size, rdvz_file):
            os.environ["TORCH_NCCL_DESYNC_DEBUG"] = "0"
            base_init_pg(cls, rank, world_size, rdvz_file)

        continuous._init_pg = _init_pg


def _swap_in_ours() -> None:
    import importlib

    import megatron_fsdp_c.per_module as ours

    for site in SWAP_SITES:
        module = importlib.import_module(site)
        for name in SWAPPED_NAMES:
            if name in vars(module):
                setattr(module, name, getattr(ours, name))


if IMPL in ("torch", "ours"):
    _emulate_devices(int(os.environ.get("MFSDP_TORCH_SUITE_DEVICES", "2")))
    if IMPL == "ours":
        _swap_in_ours()
