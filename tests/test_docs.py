"""The docs keep up with the tree: docs/design.md's Layout lists every package, and every cross-reference
(a Markdown link to a file and its section, `README "Section"` or `docs/x.md "Section"` in a
docstring) points at something that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("schemas", "pipeline", "workers", "benchmarks", "examples", "scripts")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def _markdown() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]


def test_the_design_layout_lists_every_package() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    block = design[design.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    listed, stack = set(), []
    for line in block.splitlines():
        match = re.match(r"^( *)(\S+)/ ", line)
        if match:
            depth = len(match.group(1)) // 2
            stack[depth:] = [match.group(2)]
            listed.add("/".join(stack))
    packages = {str(p.parent.relative_to(ROOT)) for top in ("schemas", "pipeline", "workers")
                for p in (ROOT / top).rglob("__init__.py")}
    missing = sorted(packages - listed)
    assert not missing, f"docs/design.md's Layout does not list {missing}"
    gone = sorted(p for p in listed if p.split("/")[0] in ("schemas", "pipeline", "workers") and p not in packages)
    assert not gone, f"docs/design.md's Layout lists packages that do not exist: {gone}"


def test_every_markdown_link_to_a_file_and_section_resolves() -> None:
    broken = []
    for page in _markdown():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+://|^mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in {_slug(h) for h in _headings(resolved)}:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such section)")
    assert not broken, "\n".join(broken)


def test_every_named_section_a_docstring_or_page_points_at_exists() -> None:
    pages = {"README": ROOT / "README.md", **{f"docs/{p.name}": p for p in (ROOT / "docs").glob("*.md")},
             **{p.name: p for p in (ROOT / "docs").glob("*.md")}}
    broken = []
    files = [p for top in SOURCES for p in (ROOT / top).rglob("*.py")] + _markdown()
    for path in files:
        text = path.read_text()
        for page, section in re.findall(r"\b(README|DESIGN\.md|(?:docs/)?[a-z_-]+\.md) \"([^\"]+)\"", text):
            target = pages.get(page)
            if target is None:
                broken.append(f"{path.relative_to(ROOT)}: {page} \"{section}\" (no such page in the repo)")
            elif section not in _headings(target) and not any(h.startswith(section) for h in _headings(target)):
                broken.append(f"{path.relative_to(ROOT)}: {page} \"{section}\" (no such section)")
    assert not broken, "\n".join(broken)


def test_the_readme_reads_in_one_sitting() -> None:
    """The README is the newcomer's page: reference material belongs in docs/ (issue 55: <= 400 lines)."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 400, f"README.md has {lines} lines; move reference material to docs/"
