"""ShardedCore: what a sharded model's state does with its engine, shared by the Megatron-FSDP
style wrapper (megatron_fsdp.py) and the per-module API (experimental/): swapping compute and
distributed parameters, the unused-parameter flags, attaching gradients, introspection.

A subclass provides `param_buffer` (ParamBuffer), `dist_ctx` (DistContext), `_used` and
`_has_grad` (a byte per record, see [Note: unused parameters] in megatron_fsdp.py) and
`_holds_dist_params`.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import _C
from .hooks import _grad_tensors
from .param_buffer import StorageTally

__all__ = ["ShardedCore"]


def host_trim_bytes() -> int:
    raw = os.environ.get("MFSDP_HOST_TRIM_BYTES", str(64 << 20))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"MFSDP_HOST_TRIM_BYTES={raw!r}: give a byte count (e.g. 67108864), or 0 to never "
                         "trim the CPU heap")
    return value


class ShardedCore:
    # -- the host heap (CPU) ----------------------------------------------------------------
    def _setup_host_heap(self, device) -> None:
        """CPU only: keep freed buffers for reuse, and trim the heap after a backward once resident
        memory grew by more than MFSDP_HOST_TRIM_BYTES (0: neither; see [Note: host heap trim]
        in csrc/python/host_heap.c)."""
        self._host_trim_bytes = host_trim_bytes() if device.type == "cpu" else 0
        if self._host_trim_bytes > 0:
            _C.keep_host_heap()

    def _trim_host_heap(self) -> None:
        if self._host_trim_bytes > 0:
            _C.trim_host_heap(self._host_trim_bytes)

    # -- parameters -----------------------------------------------------------------------
    def _swap_params(self, dist: bool) -> None:
        """Registers the distributed (dist=True) or the compute parameters on the modules."""
        if self._holds_dist_params == dist:
            return
        for r in self.param_buffer.records:
            p = r.dist_param if dist else r.param
            for mod, attr in r.places:
                mod._parameters[attr] = p
        self._holds_dist_params = dist

    def _finish_root_forward(self, output):
        """The root's post-forward work: the hooks' settling, then the sharded parameters back
        on the modules when no backward will come to swap them (no grad, or no graph)."""
        output = self.hooks.root_post_forward(output)
        if not torch.is_grad_enabled() or not _grad_tensors(output):
            self._swap_params(dist=True)
        return output

    # -- gradients ------------------------------------------------------------------------
    def _used_anywhere(self) -> bytes:
        """The used-parameter bytes OR-ed over the data-parallel ranks (one small collective)."""
        ctx = self.dist_ctx
        if ctx.dp_world == 1:
            return bytes(self._used)
        flags = torch.frombuffer(bytearray(self._used), dtype=torch.uint8).to(ctx.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=ctx.all_dp_group)
        return bytes(flags.cpu().numpy()) if flags.is_cuda else bytes(flags.numpy())

    def _attach_grads(self, records) -> None:
        """`.grad` of each distributed parameter of `records`: its gradient DTensor once some
        rank used it, None until then (see [Note: unused parameters] in megatron_fsdp.py)."""
        used = self._used_anywhere()
        has = self._has_grad
        for r in records:
            if r.grad_dtensor is not None:
                if used[r.index]:
                    has[r.index] = 1
                r.dist_param.grad = r.grad_dtensor if has[r.index] else None

    # -- introspection --------------------------------------------------------------------
    @torch.no_grad()
    def full_parameters(self) -> dict:
        """{name: full tensor} of the main weights, gathered on every rank (collective)."""
        return {r.name: r.dist_param.full_tensor().clone() for r in self.param_buffer.records}

    @torch.no_grad()
    def full_grads(self) -> dict:
        """{name: full tensor} of the optimizer gradients (after a sync), gathered on every
        rank (collective); frozen parameters are left out."""
        return {r.name: r.grad_dtensor.full_tensor().clone() for r in self.param_buffer.records
                if r.grad_dtensor is not None}

    def memory_report(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
        """Bytes this rank holds now: parameters (compute + main), gradients, optimizer state,
        and temporary buffers currently materialised (full weights / gradient buckets)."""
        buf = self.param_buffer
        nbytes = StorageTally()
        persistent, temporary = {"param": 0, "grad": 0}, 0
        for b, spec in enumerate(buf.specs):
            t = lambda kind: buf.engine.tensor(b, kind)  # noqa: E731
            weight_full = t(_C.BUF_WEIGHT)
            if spec["weights_sharded"]:
                temporary += nbytes(weight_full)
            else:
                persistent["param"] += nbytes(weight_full)
            temporary += nbytes(t(_C.BUF_GATHER))
            persistent["param"] += nbytes(t(_C.BUF_WEIGHT_SHARD)) + nbytes(t(_C.BUF_MAIN_SHARD))
            grad_full = t(_C.BUF_GRAD)
            if spec["grad_mode"] == _C.GRAD_SCATTER_ACCUMULATE:
                temporary += nbytes(grad_full)
            else:
                persistent["grad"] += nbytes(grad_full)
            persistent["grad"] += nbytes(t(_C.BUF_GRAD_SHARD)) + nbytes(t(_C.BUF_OPT_GRAD))
            temporary += nbytes(t(_C.BUF_COMM)) + nbytes(t(_C.BUF_EXCHANGE))
        optim = 0
        if optimizer is not None:
            for state in optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        optim += nbytes(v)
        report = {"param_bytes": persistent["param"], "grad_bytes": persistent["grad"],
                  "optimizer_state_bytes": optim, "temporary_bytes": temporary}
        report["total_bytes"] = sum(report.values())
        return report

    def comm_stats(self, bucket: int = -1) -> dict:
        """Collectives issued so far (counts and bytes), for one bucket or all."""
        return self.param_buffer.engine.stats(bucket)

