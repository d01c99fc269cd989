"""The supported torch range ([Note: supported torch versions] in megatron_fsdp_c/_torch_compat.py):
a torch below it stops the import with an ImportError naming the range, one above it warns, and the
per-module fully_shard refuses a torch whose FSDPModule has public methods ours does not override.
The import checks run in a fresh interpreter whose torch reports another version (the package is
imported for real there)."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from megatron_fsdp_c import _torch_compat


def _imports_with_torch_versions(*versions: str) -> list:
    """What `import megatron_fsdp_c` does under a torch reporting each version, in one fresh
    interpreter (the package and its modules are dropped from sys.modules between the tries, so
    each import runs its check again)."""
    code = textwrap.dedent(f"""
        import sys, warnings
        import torch
        for version in {list(versions)!r}:
            torch.__version__ = version
            for name in [m for m in sys.modules if m.split(".")[0] == "megatron_fsdp_c" and m != "megatron_fsdp_c._C"]:
                del sys.modules[name]
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                try:
                    import megatron_fsdp_c
                except ImportError as e:
                    print("ImportError:", e)
                else:
                    print("imported;", "; ".join(str(w.message) for w in seen if "megatron_fsdp_c" in str(w.message)))
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert len(lines) == len(versions), out.stdout + out.stderr
    return lines


def test_the_range_is_checked_at_import():
    below, above, inside = _imports_with_torch_versions("2.10.1+cu128", "2.16.0.dev20261120", "2.11.0+cu130")
    assert below.startswith("ImportError: megatron_fsdp_c supports torch 2.11 through 2.15, but this is torch "
                            "2.10.1+cu128"), below
    assert "pip install 'torch>=2.11,<2.16'" in below, below
    assert above.startswith("imported;") and "tested with torch 2.11 through 2.15" in above \
        and "2.16.0.dev20261120" in above, above
    assert inside.strip() == "imported;", inside  # and no warning


def test_the_range_is_pyprojects():
    import pathlib
    text = (pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert f'dependencies = ["{_torch_compat.SUPPORTED}"]' in text
    assert _torch_compat.OLDEST <= _torch_compat.TORCH, torch.__version__


@pytest.mark.parametrize("version,parsed", [("2.11.0+cu130", (2, 11)), ("2.15.0", (2, 15)),
                                            ("2.16.0.dev20261101", (2, 16)), ("3.0.0a0+git1234", (3, 0))])
def test_versions_parse(version, parsed):
    assert _torch_compat.parse_version(version) == parsed


def test_fully_shard_refuses_a_torch_with_fsdpmodule_methods_ours_lack(monkeypatch):
    """A newer torch that adds a public FSDPModule method: the per-module fully_shard stops with the
    names, before touching the module (frameworks would call the method and reach torch's internals)."""
    from megatron_fsdp_c.per_module import fully_shard
    from megatron_fsdp_c.per_module._module import missing_overrides
    assert missing_overrides() == [], "every public method of this torch's FSDPModule is ours"
    monkeypatch.setattr(torch.distributed.fsdp.FSDPModule, "set_something_new", lambda self: None, raising=False)
    model = nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match=r"\['set_something_new'\].*Use a torch from 2.11 to 2.15"):
        fully_shard(model)
    assert type(model) is nn.Linear
