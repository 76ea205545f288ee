"""The ```python blocks of the README and of docs/*.md, for the tests that run them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def snippets(path: Path) -> list[str]:
    """The ```python blocks of one Markdown file, in order."""
    return [m.group(1) for m in _BLOCK.finditer(path.read_text())]


def snippet(name: str, containing: str) -> str:
    """The one ```python block of ``ROOT / name`` that contains ``containing``."""
    found = [s for s in snippets(ROOT / name) if containing in s]
    assert len(found) == 1, f"{len(found)} python blocks of {name} contain {containing!r}"
    return found[0]


def all_snippets() -> dict[tuple[str, int], str]:
    return {(str(p.relative_to(ROOT)), i): s for p in doc_files() for i, s in enumerate(snippets(p))}
