"""The README is the front door and docs/ the manual: links resolve, code blocks parse, and every
"[Note: X] in FILE" pointer of the docs names a file that defines that Note. No processes, no torch."""
from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NOTE_IN = re.compile(r"\[Note: ([^\]]+)\] in\s+`([^`]+)`")


# Not sources: environments, build outputs and caches (the compatibility pass runs this file in a
# plain copy of the tree, .ci/compat, where there is no git to ask).
_SKIP_DIRS = {".git", ".venv", "venv", "build", "bin", "__pycache__", "bench_out", "node_modules"}


def source_files(*roots: str) -> list:
    """The tree's files under `roots` (default: all), relative to the root, in a stable order."""
    out = []
    for top in [ROOT / r for r in roots] or [ROOT]:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
            out += [str((pathlib.Path(dirpath) / f).relative_to(ROOT)) for f in sorted(filenames)]
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 300, f"README.md has {lines} lines: move the detail to a page of docs/"
    index = (ROOT / "docs" / "index.md").read_text()
    for page in PAGES[1:]:
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md does not list {page.name}"
            assert "](index.md)" in page.read_text(), f"docs/{page.name} does not link back to the index"


def test_links_resolve():
    bad = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here (no network)
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_code_blocks_parse():
    bad = []
    for page in PAGES:
        for lang, code in FENCE.findall(page.read_text()):
            where = f"{page.relative_to(ROOT)}: a {lang} block starting {code.splitlines()[0][:60]!r}"
            if lang == "python":
                try:
                    ast.parse(code)
                except SyntaxError as e:
                    bad.append(f"{where}: {e}")
            elif lang in ("bash", "sh"):
                r = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
                if r.returncode:
                    bad.append(f"{where}: {r.stderr.strip()}")
    assert not bad, "\n".join(bad)


def test_note_pointers_resolve():
    """A pointer names a path from the root or the end of one (`_common.py`: megatron_fsdp_c's)."""
    files = source_files()
    bad = []
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text())
        for note, file in NOTE_IN.findall(text):
            found = [f for f in files if f == file or f.endswith("/" + file)]
            if not found:
                bad.append(f"{page.relative_to(ROOT)}: [Note: {note}] in {file}: no such file")
            elif not any(f"[Note: {note}]" in re.sub(r"\s+", " ", (ROOT / f).read_text(errors="replace"))
                         for f in found):
                bad.append(f"{page.relative_to(ROOT)}: [Note: {note}] is not in {file}")
    assert not bad, "\n".join(bad)


DEFINITION = re.compile(r'^\s*(?:#|\*|//|/\*|r?""")?\s*\[Note: ([^\]]+)\]\s*(?:\*/|""")?\s*$', re.M)
POINTER = re.compile(r"\[Note: ([^\]]+)\] in `?(the Makefile|Makefile|[\w./-]+\.(?:pyi|py|cuh|cu|c|h|md|toml|sh))\b`?")


def test_note_pointers_in_the_code_resolve():
    """Every "[Note: X] in FILE" of the tracked sources (comments and docstrings) names a file that
    defines that Note (a line of its own, the Note's title): FILE relative to the citing file's
    folder, from the root, or the end of a path."""
    files = source_files()
    texts, defined = {}, {}
    for f in files:
        if f.startswith("tests/torch_suite/") or not f.endswith((".py", ".pyi", ".c", ".h", ".cu", ".cuh", ".sh",
                                                                  "Makefile", ".toml")):
            continue
        # comment markers and line breaks out, so a pointer broken over lines reads whole
        raw = (ROOT / f).read_text(errors="replace")
        texts[f] = re.sub(r"\s+", " ", re.sub(r"^\s*(#|\*|//)", " ", raw, flags=re.M))
        defined[f] = set(DEFINITION.findall(raw))
    bad = []
    for f, text in texts.items():
        for note, target in POINTER.findall(text):
            target = "Makefile" if target.endswith("Makefile") else target
            here = (ROOT / f).parent / target
            found = [str(here.resolve().relative_to(ROOT))] if here.resolve().is_relative_to(ROOT) else []
            found += [g for g in files if g == target or g.endswith("/" + target.lstrip("./"))]
            found = [g for g in found if (ROOT / g).is_file()]
            if not found:
                bad.append(f"{f}: [Note: {note}] in {target}: no such file")
            elif not any(note in (defined[g] if g in defined else DEFINITION.findall((ROOT / g).read_text()))
                         for g in found):
                bad.append(f"{f}: [Note: {note}] is not defined in {target}")
    assert not bad, "\n".join(bad)


def test_every_cited_note_is_defined():
    """A Note cited anywhere ("[Note: X]", with or without a file) is defined once: one line of its
    own in one file."""
    files = source_files()
    where: dict = {}
    cited = {}
    for f in files:
        if f.startswith("tests/torch_suite/") or f == "tests/test_docs.py" or not f.endswith(
                (".py", ".pyi", ".c", ".h", ".cu", ".cuh", ".sh", "Makefile", ".toml", ".md")):
            continue
        raw = (ROOT / f).read_text(errors="replace")
        for note in DEFINITION.findall(raw):
            where.setdefault(note, []).append(f)
        # comment markers, C string breaks ("...\n" "...") and line breaks out
        text = re.sub(r'\\n"\s*"', " ", re.sub(r"^\s*(#|\*|//)", " ", raw, flags=re.M))
        for note in re.findall(r"\[Note: ([^\]]+)\]", re.sub(r"\s+", " ", text)):
            cited.setdefault(note, f)
    undefined = [f"{f}: [Note: {n}]" for n, f in cited.items() if n not in where]
    twice = [f"[Note: {n}] defined in {', '.join(fs)}" for n, fs in where.items() if len(fs) > 1]
    assert not undefined and not twice, "\n".join(undefined + twice)


def test_every_source_file_is_on_the_map():
    """docs/design.md's "Where things are" names every module of the package and every C file
    of the engine (tests apart): a file nobody can find is a file nobody maintains."""
    design = (ROOT / "docs" / "design.md").read_text()
    table = design[design.index("## Where things are"):]
    files = source_files("megatron_fsdp_c", "csrc")
    missing = [f for f in files if f.endswith((".py", ".pyi", ".c", ".h", ".cu", ".cuh"))
               and not f.startswith("csrc/tests/") and not f.endswith("__init__.py")
               and f.rsplit("/", 1)[-1] not in table]
    assert not missing, "not in docs/design.md's Where things are: " + ", ".join(missing)


def test_one_word_per_idea():
    """docs/design.md's "One word per idea", where a grep can check it: in the engine's C, "owner"
    is not a word (Python's engine owner is; C says holder for a rank's sub-shard and storage for a
    buffer views point into)."""
    files = source_files("csrc")
    bad = [f"{f}:{n}: {line.strip()}" for f in files if f.endswith((".c", ".h", ".cu", ".cuh"))
           for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1)
           if re.search(r"\bowners?\b", line.replace("_owner.py", ""))]
    assert not bad, "'owner' in the C engine (holder: a rank's sub-shard; storage: a buffer views use):\n" + \
        "\n".join(bad)
    # retired Python names, each with the one that replaced it everywhere
    retired = {"hold_outer": "outer_hold (as the engine's set_outer_hold and the C bucket field)"}
    py = source_files("megatron_fsdp_c", "tests", "docs", "benchmarks")
    bad = [f"{f}: {old} (now {new})" for f in py if f.endswith((".py", ".pyi", ".md")) and f != "tests/test_docs.py"
           for old, new in retired.items() if re.search(rf"\b{old}\b", (ROOT / f).read_text(errors="replace"))]
    assert not bad, "\n".join(bad)


def test_records_are_whole_when_made():
    """A ParamRecord's facts (name, unit, places, sharding, TP spec, extension, ...) are set by its
    constructor only: both APIs make each record whole (per_module/_root.py, _param_record.py's
    make_records). What the buffer plans later (bucket, item, local, the DTensors) and the compute
    parameter's replacement (meta init, extension placeholders) are not facts and may follow."""
    facts = "index|name|shape|unit|places|replicated|aliases|trains_later|shard_dim|tp|extension|origin"
    assign = re.compile(rf"\b(r|rec|record)\.({facts})\s*(=[^=]|\+=|\.append\()")
    bad = [f"{f}:{n}: {line.strip()}" for f in source_files("megatron_fsdp_c") if f.endswith(".py")
           for n, line in enumerate((ROOT / f).read_text().splitlines(), 1)
           if assign.search(line) and not line.lstrip().startswith("#")]
    assert not bad, "a ParamRecord fact set after its constructor:\n" + "\n".join(bad)


def test_a_unit_is_an_index():
    """docs/design.md's "One word per idea": a unit alone is an index (ParamRecord.unit, the plan's
    "unit"); its hooks' object is a unit state (`unit_state`), its configuration a unit config, a
    module a module. An index has no attributes, so a name `unit` or `u` followed by `.` in the
    package's code is one of the others under the index's name."""
    import io
    import tokenize
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT}
    bad = []
    for f in source_files("megatron_fsdp_c"):
        if not f.endswith(".py"):
            continue
        toks = [t for t in tokenize.generate_tokens(io.StringIO((ROOT / f).read_text()).readline) if t.type not in skip]
        bad += [f"{f}:{b.start[0]}: {b.line.strip()}" for a, b, c in zip(toks, toks[1:], toks[2:])
                if b.type == tokenize.NAME and b.string in ("unit", "u") and c.string == "." and a.string != "."]
    assert not bad, "a unit (an index) used as an object:\n" + "\n".join(bad)
