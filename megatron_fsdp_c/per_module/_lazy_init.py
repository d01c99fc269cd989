"""What the per-module API's lazy init walks and checks before it builds the engines (see
[Note: a mesh per group] in _root.py): the groups under a root, the meshes they are on (across
ranks, also when fully_shard first meets a mesh over some of the ranks), materialised
parameters, the order modules end their forwards. Imports only _distributed's partition check."""
from __future__ import annotations

from typing import List

import torch.distributed as dist
import torch.nn as nn

from .._distributed import check_rank_partition

__all__ = ["check_materialised", "check_meshes", "check_sub_mesh", "groups_under", "post_order"]


def groups_under(root: nn.Module) -> list:
    """The groups under `root`, in module order (a refusal for one initialised as its own root)."""
    groups = []
    for name, m in root.named_modules():
        g = getattr(m, "_mfsdp_group", None)
        if g is not None and g not in groups:
            if g.owner is not None:  # lazily initialised before the model around it was sharded
                raise RuntimeError(
                    f"FSDP state has already been lazily initialized for {name}\nFSDP requires running forward "
                    f"through the root module first: the sharded {type(m).__name__} ran a forward (or unshard()) "
                    "as its own root before fully_shard was applied to the model around it; apply fully_shard to "
                    "every module first, then run the first forward through the outermost sharded module")
            groups.append(g)
    return groups


def _ranks(ctx) -> tuple:
    return tuple(sorted(int(r) for r in ctx.mesh.mesh.flatten().tolist()))


def check_meshes(root: nn.Module, parts: List[list]) -> None:
    """The checks of [Note: a mesh per group] for a model on several meshes."""
    names = {id(mod): name for name, mod in root.named_modules(remove_duplicate=False)}
    first = {}  # origin -> (its first name, the context of its group)
    for part in parts:
        for g in part:
            for mod, attr, dp in g.places:
                origin = getattr(dp, "_mfsdp_origin", None)
                name = f"{names.get(id(mod), type(mod).__name__)}.{attr}".lstrip(".")
                seen = first.setdefault(origin, (name, g.ctx)) if origin is not None else (name, g.ctx)
                if seen[1] is not g.ctx:
                    raise ValueError(
                        f"parameter '{name}' (also registered as '{seen[0]}') is in groups on two different meshes "
                        f"(ranks {_ranks(seen[1])} and {_ranks(g.ctx)}): a parameter is sharded over one mesh. Put "
                        "every module that holds it in one fully_shard call (fully_shard([module_a, module_b], "
                        "mesh=...)) or shard their common parent, or untie it")
    root_ctx = parts[0][0].ctx
    mine = [_ranks(part[0].ctx) for part in parts]
    group = root_ctx.all_dp_group
    table = [None] * dist.get_world_size(group)
    dist.all_gather_object(table, mine, group=group)
    everyone = dict(zip(dist.get_process_group_ranks(group), table))
    problems = []
    if len({len(t) for t in table}) > 1:
        problems.append("the ranks shard this model over different numbers of meshes "
                        f"({ {r: len(t) for r, t in everyone.items()} })")
    else:
        world = len(everyone)
        for i in range(1, len(mine)):
            for r, t in everyone.items():
                s = t[i]
                if r not in s or not set(s) <= set(everyone):
                    problems.append(f"mesh #{i} of rank {r} spans ranks {s}, which must include rank {r} and lie "
                                    f"within the root mesh's ranks {sorted(everyone)}")
                elif world % len(s):
                    problems.append(f"mesh #{i} spans {len(s)} ranks {s}, which does not divide the root mesh's "
                                    f"{world} ranks")
                else:
                    odd = [q for q in s if everyone[q][i] != s]
                    if odd:
                        problems.append(f"mesh #{i} is ranks {s} on rank {r} but {everyone[odd[0]][i]} on rank "
                                        f"{odd[0]}: overlapping meshes with inconsistent rank sets")
                if problems:
                    break
    if problems:
        raise ValueError(
            "the meshes of this model's fully_shard calls do not fit together: " + "; ".join(problems[:3])
            + ". Slice every mesh from one DeviceMesh over the root mesh's ranks (e.g. init_device_mesh(device, "
            "(dp // ep, ep), mesh_dim_names=('dp_mod_ep', 'ep')) and pass mesh['dp_mod_ep'] to the experts' "
            "fully_shard), so that each mesh's rank sets partition the ranks with a size dividing their number "
            "([Note: a mesh per group] in megatron_fsdp_c/per_module/_root.py)")


def check_materialised(groups: list, fqn) -> None:
    """FSDP2's check at the lazy init, with its words: the first group (in the model's module
    order) that still has parameters on the meta device is named with all of them."""
    for g in groups:
        on_meta = list(dict.fromkeys(fqn(mod, attr) for mod, attr, dp in g.places if dp.device.type == "meta"))
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the following were "
                f"still on meta device: {on_meta}\nmaterialise the model after fully_shard: model.to_empty(device=...) "
                "then reset_parameters() / init_weights() on each module (or load_state_dict(sharded_sd, assign=True))")


def post_order(root: nn.Module) -> List[nn.Module]:
    """The modules under `root` in the order their forwards end (children first), each once."""
    out, stack, seen = [], [(root, False)], set()
    while stack:
        mod, done = stack.pop()
        if done:
            out.append(mod)
            continue
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        stack.append((mod, True))
        stack.extend((child, False) for child in reversed(list(mod.children())))
    return out


def check_sub_mesh(ranks: tuple) -> None:
    """A mesh over some of the ranks (expert parallelism's dp_mod_ep, a data-parallel dim of a
    larger mesh): before its communicators are made (new_group over its ranks, which would hang on
    rank sets the ranks disagree on), _distributed.check_rank_partition checks that the meshes
    this fully_shard call got on the ranks partition them ([Note: a mesh per group] in _root.py).
    Every rank raises the same error."""
    check_rank_partition(
        ranks, "fully_shard got meshes that do not partition the ranks",
        "Slice every mesh from one DeviceMesh over all ranks (e.g. init_device_mesh(device, (dp // ep, ep), "
        "mesh_dim_names=('dp_mod_ep', 'ep')) and pass mesh['dp_mod_ep'] to the experts' fully_shard), so that the "
        "ranks of each mesh agree on it and its size divides the world ([Note: a mesh per group] in "
        "megatron_fsdp_c/per_module/_root.py)")
