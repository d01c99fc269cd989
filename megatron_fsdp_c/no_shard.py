"""fsdp_no_shard: keep chosen modules or parameters replicated inside a sharded model.

Marked parameters form their own buckets (the grouping key carries the mark): one full copy per
rank, never all-gathered, no unshard/reshard hooks; trainable ones get one averaged all-reduce
per optimisation step (respecting no_sync and auto-sync), frozen ones get no gradient memory.

The mark lives on the owning modules as attribute names, so it survives what replaces
Parameter objects (meta-device materialisation with `to_empty`, `reset_parameters`, `.to()`),
not only on the Parameter object itself.
"""
from __future__ import annotations

from typing import Iterable, List, Union

import torch.nn as nn

__all__ = ["fsdp_no_shard", "is_no_shard", "replicated_roots"]

_MODULE_MARK = "_mfsdp_no_shard_module"   # the whole subtree is replicated
_PARAM_MARKS = "_mfsdp_no_shard_params"   # attribute names of this module's own marked params
_PARAM_MARK = "_mfsdp_no_shard"           # on a Parameter object


def _check_not_sharded(obj) -> None:
    params = list(obj.parameters()) if isinstance(obj, nn.Module) else [obj]
    if getattr(obj, "_megatron_fsdp_wrapper", None) is not None or any(
            getattr(p, "_mfsdp_model_ref", None) is not None for p in params):
        raise RuntimeError(
            "fsdp_no_shard must be called before fully_shard: the layout is fixed when the model is sharded. "
            "Mark the modules/parameters first, then call fully_shard"
        )


def fsdp_no_shard(module_or_param: Union[nn.Module, nn.Parameter, Iterable]) -> Union[nn.Module, nn.Parameter, list]:
    """Marks a module (all its parameters, recursively), a Parameter, or an iterable of either
    as replicated. Returns its argument. Call before fully_shard."""
    if isinstance(module_or_param, nn.Module):
        _check_not_sharded(module_or_param)
        for sub in module_or_param.modules():
            setattr(sub, _MODULE_MARK, True)
        return module_or_param
    if isinstance(module_or_param, nn.Parameter):
        _check_not_sharded(module_or_param)
        setattr(module_or_param, _PARAM_MARK, True)
        return module_or_param
    if isinstance(module_or_param, (str, bytes)) or not hasattr(module_or_param, "__iter__"):
        raise TypeError(
            f"fsdp_no_shard takes an nn.Module, an nn.Parameter or an iterable of them, not "
            f"{type(module_or_param).__name__}"
        )
    items = list(module_or_param)
    for i, item in enumerate(items):
        if not isinstance(item, (nn.Module, nn.Parameter)):
            raise TypeError(
                f"fsdp_no_shard: item {i} of the iterable is a {type(item).__name__}; pass nn.Module or nn.Parameter"
            )
    return [fsdp_no_shard(item) for item in items]


def mark_by_name(root: nn.Module) -> None:
    """Records Parameter-level marks on the owning modules, so they outlive the Parameter."""
    for mod in root.modules():
        names = {attr for attr, p in mod._parameters.items() if p is not None and getattr(p, _PARAM_MARK, False)}
        if names:
            setattr(mod, _PARAM_MARKS, set(getattr(mod, _PARAM_MARKS, set())) | names)


def is_no_shard(module: nn.Module, attr: str) -> bool:
    """Is parameter `attr` registered on `module` marked replicated?"""
    if getattr(module, _MODULE_MARK, False) or attr in getattr(module, _PARAM_MARKS, ()):
        return True
    p = module._parameters.get(attr)
    return p is not None and bool(getattr(p, _PARAM_MARK, False))


def replicated_roots(root: nn.Module, replicated_params) -> List[str]:
    """Names of the outermost modules whose parameters are all replicated (and non-empty)."""
    ids = {id(p) for p in replicated_params}
    roots, inside = [], set()
    for name, mod in root.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        params = list(mod.parameters())
        if params and all(id(p) in ids for p in params):
            roots.append(name or "<root>")
            inside.add(name)
    return roots
