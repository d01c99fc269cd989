"""megatron_fsdp_c/_C.pyi against the extension it describes: the built module (names, each
type's methods and properties, the constants' types) and the C sources (csrc/python/*.c: each
function's parameters against its PyArg_Parse* format, kwlist and doc-string header). Parsed
with `ast` and regexes; no process.

Names whose stub docstring starts "CUDA build only" exist only in a CUDA build; the module has
all of them or none (hasattr(_C, "NcclTransport") tells the build, as _nccl.py asks). The source
checks cover them in either build."""
import ast
import pathlib
import re
import types
import typing

import torch

from megatron_fsdp_c import _C

REPO = pathlib.Path(__file__).resolve().parent.parent
STUB = REPO / "megatron_fsdp_c" / "_C.pyi"
SOURCES = {p.name: p.read_text() for p in sorted((REPO / "csrc" / "python").glob("*.c"))}
CUDA_ONLY_MARK = "CUDA build only"
CUDA_BUILD = hasattr(_C, "NcclTransport")

TREE = ast.parse(STUB.read_text(), filename=str(STUB))


# ------------------------------------------------------------------------------------------------
# the stub

def _is_type_alias(node: ast.stmt) -> bool:
    return isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) == "TypeAlias"


def _stub_names(body):
    """name -> (node, docstring) of every definition in a stub body; type aliases are the stub's own."""
    out = {}
    for i, node in enumerate(body):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = (node, ast.get_docstring(node))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not _is_type_alias(node):
            after = body[i + 1] if i + 1 < len(body) else None  # an attribute docstring, if any
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str) else None
            out[node.target.id] = (node, doc)
    return out


STUB_NAMES = _stub_names(TREE.body)
CUDA_ONLY = {n for n, (_, doc) in STUB_NAMES.items() if doc and doc.startswith(CUDA_ONLY_MARK)}
CLASSES = {n: node for n, (node, _) in STUB_NAMES.items() if isinstance(node, ast.ClassDef)}


def _members(cls: ast.ClassDef):
    """name -> "property" | "method" of a stub class's public members."""
    out = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
            is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
            out[node.name] = "property" if is_property else "method"
    return out


def _stub_function(owner: str, name: str) -> ast.FunctionDef | None:
    body = CLASSES[owner].body if owner else TREE.body
    return next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _params(fn: ast.FunctionDef, method: bool):
    """(positional-only names, positional-or-keyword names, required count) of a stub function."""
    a = fn.args
    pos_only, pos = [x.arg for x in a.posonlyargs], [x.arg for x in a.args]
    if method:
        (pos_only if pos_only else pos).pop(0)  # self
    return pos_only, pos, len(pos_only) + len(pos) - len(a.defaults)


def _where(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


# ------------------------------------------------------------------------------------------------
# the built module

def test_stub_and_module_have_the_same_names():
    module = {n for n in dir(_C) if not n.startswith("__")}
    expected = set(STUB_NAMES) if CUDA_BUILD else set(STUB_NAMES) - CUDA_ONLY
    build = "CUDA" if CUDA_BUILD else "CPU"
    assert not module - expected, f"in _C but missing from _C.pyi: {sorted(module - expected)}"
    assert not expected - module, f"in _C.pyi but not in this ({build}) build's _C: {sorted(expected - module)}" \
        + ("" if CUDA_BUILD else f" (mark CUDA-only names with a docstring starting '{CUDA_ONLY_MARK}')")
    present = CUDA_ONLY & module
    assert not present or present == CUDA_ONLY, f"a build has all CUDA-only names or none; this one lacks " \
                                                f"{sorted(CUDA_ONLY - present)}"


def test_every_stub_name_is_documented():
    undocumented = [n for n, (_, doc) in STUB_NAMES.items() if not doc and not n.startswith(("BUF_", "GRAD_"))]
    undocumented += [f"{c}.{n}" for c, cls in CLASSES.items() for n in _members(cls)
                     if not ast.get_docstring(_stub_function(c, n))]
    assert not undocumented, f"_C.pyi names without a docstring: {undocumented}"


def test_each_type_has_the_stub_members():
    problems = []
    for name, cls in CLASSES.items():
        if not hasattr(_C, name):
            continue  # a CUDA-only type in a CPU build: test_signatures_follow_the_c_sources covers it
        runtime = getattr(_C, name)
        bases = [ast.unparse(b) for b in cls.bases] or ["object"]
        if bases != [b.__name__ for b in runtime.__bases__]:
            problems.append(f"{name}: bases {bases} in the stub, {[b.__name__ for b in runtime.__bases__]} in _C")
        # the type's own members: getset descriptors are properties, the rest methods
        own = {n: "property" if isinstance(v, types.GetSetDescriptorType) else "method"
               for n, v in vars(runtime).items() if not n.startswith("__")}
        stub = _members(cls)
        if set(own) - set(stub):
            problems.append(f"{name}: in _C but missing from _C.pyi: {sorted(set(own) - set(stub))}")
        if set(stub) - set(own):
            problems.append(f"{name}: in _C.pyi but not in _C: {sorted(set(stub) - set(own))}")
        problems += [f"{name}.{n}: a {own[n]} in _C, a {stub[n]} in _C.pyi" for n in set(own) & set(stub)
                     if own[n] != stub[n]]
    assert not problems, "\n".join(problems)


def _conforms(value, annotation) -> bool:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is None:
        return isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(k, args[0]) and _conforms(v, args[1])
                                               for k, v in value.items())
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return isinstance(value, tuple) and all(_conforms(v, args[0]) for v in value)
        return isinstance(value, tuple) and len(value) == len(args) and all(map(_conforms, value, args))
    raise AssertionError(f"the test cannot check annotations like {annotation}: teach _conforms")


def test_constants_have_their_annotated_types():
    scope = {"torch": torch, **{n: getattr(typing, n) for n in typing.__all__}}
    wrong = []
    for name, (node, _) in STUB_NAMES.items():
        if isinstance(node, ast.AnnAssign) and hasattr(_C, name):
            annotation = eval(ast.unparse(node.annotation), scope)  # noqa: S307 - the stub's own text
            value = getattr(_C, name)
            if not _conforms(value, annotation):
                wrong.append(f"{name} = {value!r} is not {ast.unparse(node.annotation)}")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------------------------------------
# the C sources

def _format_counts(fmt: str):
    """(required, optional) arguments of a PyArg_Parse* format (no tuples, no keyword-only '$')."""
    assert "(" not in fmt and "$" not in fmt, f"format {fmt!r}: teach _format_counts"
    required, _, optional = fmt.partition("|")
    units = lambda s: len(re.sub(r"[*#&!]", "", s))  # noqa: E731 - modifiers belong to the unit before
    return units(required), units(optional)


def _doc_header(doc_token: str, text: str):
    """The argument names of a doc string's leading "name(a, b=1, ...)", or None. doc_token is the
    PyMethodDef's doc: a string literal or a PyDoc_STRVAR name."""
    if not doc_token.startswith('"'):
        m = re.search(rf"PyDoc_STRVAR\({doc_token},\s*(\"[^\"]*)", text)
        doc_token = m.group(1) if m else ""
    m = re.match(r'"\w+\(([^)]*)\)', doc_token)
    if m is None:
        return None
    return [re.match(r"\s*(\w+)", seg).group(1) for seg in m.group(1).split(",") if seg.strip()]


def _c_surface():
    """What csrc/python/*.c defines: (owner, name) -> (METH_ flag or "property", doc-header names);
    formats, name -> format of "format:name" literals; kwlists, type -> (names, format). The owner
    is "" for module functions, else the type (one per file) whose slots name the table."""
    defs, formats, kwlists = {}, {}, {}
    for file, text in SOURCES.items():
        types_here = re.findall(r'\.name = "megatron_fsdp_c\._C\.(\w+)"', text)
        assert len(types_here) <= 1, f"{file}: one type per file, found {types_here}"
        slots = dict((t, kind) for kind, t in re.findall(r"\{Py_tp_(methods|getset), (\w+)\}", text))
        for kind, table, body in re.findall(r"static (PyMethodDef|PyGetSetDef) (\w+)\[\] = \{(.*?)\n\};", text, re.S):
            owner = types_here[0] if table in slots else ""
            entries = re.findall(r'\{"(\w+)",\s*[^,{}]+,\s*(METH_\w+|NULL),\s*("(?:[^"\\]|\\.)*"|\w+)', body)
            assert len(entries) == body.count('{"'), f"{file}: {table} has entries the regex misses"
            for name, flag, doc in entries:
                defs[(owner, name)] = ("property" if kind == "PyGetSetDef" else flag,
                                       _doc_header(doc, text) if kind == "PyMethodDef" else None)
        for fmt, name in re.findall(r'"([A-Za-z*#&!|$]*):(\w+)"', text):
            assert formats.setdefault(name, fmt) == fmt, f"two formats named {name}"
        for names, fmt, name in re.findall(r"kwlist\[\] = \{([^}]*)\};.*?PyArg_ParseTupleAndKeywords\([^\"]*"
                                           r"\"([^\"]*):(\w+)\"", text, re.S):
            kwlists[name] = (re.findall(r'"(\w+)"', names), fmt)
    return defs, formats, kwlists


DEFS, FORMATS, KWLISTS = _c_surface()


def test_the_source_scan_finds_the_surface():
    """The regexes see what they should (so a pass means something)."""
    assert ("", "plan") in DEFS and ("Engine", "grad_ready") in DEFS and ("NcclTransport", "close") in DEFS
    assert DEFS[("Engine", "broken")][0] == "property" and DEFS[("", "cuda_pack_")][0] == "METH_VARARGS"
    assert FORMATS["set_hold"] == "Op" and FORMATS["plan"] == "OiiLi|iL"
    assert set(KWLISTS) == {"Engine", "TorchTransport", "NcclTransport"}
    assert DEFS[("Engine", "init_begin")][1] == ["bucket", "direct"]


def test_constructors_take_the_kwlists():
    """Types parse keywords: the stub's __init__ has the kwlist's names, in order, as ordinary
    parameters, and as many without a default as the format requires."""
    problems = []
    for name, (kwlist, fmt) in KWLISTS.items():
        init = _stub_function(name, "__init__") if name in CLASSES else None
        if init is None:
            problems.append(f"{name}.__init__ is missing from _C.pyi")
            continue
        pos_only, pos, required = _params(init, method=True)
        if pos_only:
            problems.append(f"{name}.__init__: C takes keywords; drop the '/' in _C.pyi")
        if pos_only + pos != kwlist:
            stub = pos_only + pos
            missing, extra = [n for n in kwlist if n not in stub], [n for n in stub if n not in kwlist]
            problems.append(f"{name}.__init__: kwlist names missing from _C.pyi {missing}, _C.pyi names not in the "
                            f"kwlist {extra}" + ("" if missing or extra else f", order {stub} vs {kwlist}"))
        if required != _format_counts(fmt)[0]:
            problems.append(f"{name}.__init__: {required} required in _C.pyi, {_format_counts(fmt)[0]} in C "
                            f"(format {fmt!r})")
    assert not problems, "\n".join(problems)


def test_signatures_follow_the_c_sources():
    """Functions and methods without keywords: positional-only in the stub, with the count of
    required and optional arguments of the C side (METH_NOARGS: none, METH_O: one, METH_VARARGS:
    its format, METH_FASTCALL: its doc header) and the names of its doc-string header."""
    problems = []
    for (owner, name), (flag, doc_names) in sorted(DEFS.items()):
        where = _where(owner, name)
        if owner and owner not in CLASSES:
            problems.append(f"{owner} (the type of {where}) is missing from _C.pyi")
            continue
        if flag == "property":
            if _members(CLASSES[owner]).get(name) != "property":
                problems.append(f"{where}: a property in C, not one in _C.pyi")
            continue
        fn = _stub_function(owner, name)
        if fn is None:
            problems.append(f"{where} is missing from _C.pyi")
            continue
        pos_only, pos, required = _params(fn, method=bool(owner))
        if pos or fn.args.kwonlyargs:
            problems.append(f"{where}: C takes no keywords; make {pos + [a.arg for a in fn.args.kwonlyargs]} "
                            "positional-only (before '/') in _C.pyi")
        counts = {"METH_NOARGS": (0, 0), "METH_O": (1, 0)}.get(flag)
        if flag == "METH_VARARGS":
            counts = _format_counts(FORMATS[name]) if name in FORMATS else None
        elif flag == "METH_FASTCALL" and doc_names is not None:
            counts = (len(doc_names), 0)
        if counts is None:
            problems.append(f"{where}: cannot tell its C arguments ({flag}, no 'format:{name}' literal)")
        elif (required, len(pos_only + pos) - required) != counts:
            problems.append(f"{where}: {required} required + {len(pos_only + pos) - required} optional in _C.pyi, "
                            f"{counts[0]} + {counts[1]} in C")
        if doc_names is not None and doc_names != pos_only + pos:
            problems.append(f"{where}: arguments {pos_only + pos} in _C.pyi, {doc_names} in its C doc string")
    stub_functions = {("", n) for n, (node, _) in STUB_NAMES.items() if isinstance(node, ast.FunctionDef)}
    stub_functions |= {(c, n) for c, cls in CLASSES.items() for n in _members(cls)}
    problems += [f"{_where(*k)}: in _C.pyi but defined nowhere in csrc/python/*.c"
                 for k in sorted(stub_functions - set(DEFS))]
    assert not problems, "\n".join(problems)
