"""What an engine holds, in bytes and where: the memory report of both APIs (ParamBuffer's)."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C


class StorageTally:
    """Counts bytes of storage, each storage once: views, aliases and DTensor local tensors
    share their owner's bytes; released (0-byte) storage counts nothing."""

    def __init__(self):
        self.seen = set()

    def __call__(self, t) -> int:
        if t is None:
            return 0
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in self.seen:
            return 0
        self.seen.add(s.data_ptr())
        return s.nbytes()


def memory_report(engine, specs, optimizer: Optional[torch.optim.Optimizer] = None, locations: bool = False) -> dict:
    """Bytes this rank holds now: parameters (compute + main), gradients, optimizer state (of
    `optimizer`), and temporary buffers currently materialised (full weights / gradient buckets),
    every value a byte count; with `locations`, also "locations": on which devices each kind of
    state lives (where_held)."""
    nbytes = StorageTally()
    persistent, temporary = {"param": 0, "grad": 0}, 0
    for b, spec in enumerate(specs):
        t = lambda kind: engine.tensor(b, kind)  # noqa: E731
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
        temporary += sum(nbytes(t(kind)) for kind in (_C.BUF_GATHER_WIRE, _C.BUF_GRAD_WIRE, _C.BUF_OUTER_WIRE))
    optim = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    optim += nbytes(v)
    report = {"param_bytes": persistent["param"], "grad_bytes": persistent["grad"],
              "optimizer_state_bytes": optim, "temporary_bytes": temporary}
    report["total_bytes"] = sum(report.values())
    if locations:
        report["locations"] = where_held(engine, len(specs), optimizer)
    return report


def where_held(engine, n_buckets: int, optimizer) -> dict:
    """Where each kind of state lives: kind -> sorted device names (empty: none held now)."""
    found = {"compute_weights": set(), "main_weights": set(), "main_grads": set(), "optimizer_state": set()}

    def first(b, *kinds):
        for kind in kinds:
            t = engine.tensor(b, kind)
            if t is not None:
                return t
        return None
    for b in range(n_buckets):
        for key, t in (("compute_weights", first(b, _C.BUF_WEIGHT)),
                       ("main_weights", first(b, _C.BUF_MAIN_SHARD, _C.BUF_WEIGHT_SHARD, _C.BUF_WEIGHT)),
                       ("main_grads", first(b, _C.BUF_OPT_GRAD, _C.BUF_GRAD_SHARD, _C.BUF_GRAD))):
            if t is not None:
                found[key].add(str(t.device))
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # not the step counters
                    found["optimizer_state"].add(str(getattr(v, "_local_tensor", v).device))
    return {k: sorted(v) for k, v in found.items()}
