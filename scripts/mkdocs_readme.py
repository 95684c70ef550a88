"""MkDocs hook: the site's home page is the README, so the front door is written once.

``docs/index.md`` is a stub; at build time its markdown is replaced by README.md with
the ``docs/`` prefix taken off its links (they are relative to the repository root on
GitHub and relative to ``docs/`` on the site). Registered in mkdocs.yml (``hooks:``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    return README.read_text(encoding="utf-8").replace("](docs/", "](")
