"""The README is the front door and docs/ the manual: links resolve, code blocks parse, and every
"[Note: X] in FILE" pointer of the docs names a file that defines that Note. No processes, no torch."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NOTE_IN = re.compile(r"\[Note: ([^\]]+)\] in\s+`([^`]+)`")


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
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
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
