"""The docs name files of this repository in backticks (`hpc/chain.py`, `jobs/x.yaml`):
each such reference must exist, so a rename that forgets the docs fails here.
``mkdocs build --strict`` in CI checks the links between pages; this checks the code
references that are not links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: A backticked path under one of the repository's top folders, ending in a file
#: extension or "/" (bare words such as the metric ``ddp/world_size`` are not files).
REFERENCE = re.compile(
    r"`((?:hpc|src|ddp|tests|bench|jobs|configs|templates|examples|scripts|docs|\.ci)"
    r"/[^`\s:*{}<>]*(?:\.[A-Za-z0-9]+|/))[`:]"
)
#: A path segment in capitals is a placeholder (``templates/NAME.sh.j2``).
PLACEHOLDER = re.compile(r"(^|/)[A-Z_]+(\.|/|$)")


def references() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for match in REFERENCE.finditer(page.read_text(encoding="utf-8")):
            ref = match.group(1)
            if not PLACEHOLDER.search(ref):
                found.append((page.relative_to(ROOT).as_posix(), ref))
    return found


def test_the_docs_name_files_at_all():
    # The pattern must keep matching what the pages write, or the next test checks nothing.
    assert len(references()) > 50


@pytest.mark.parametrize("page,ref", references())
def test_every_file_the_docs_name_exists(page: str, ref: str):
    # `ddp/x.py` is the package's path as users import it; it lives under src/.
    assert (ROOT / ref).exists() or (ROOT / "src" / ref).exists(), f"{page} names {ref}"
