"""The documentation names no file that is not there: its links, the repository paths it quotes and
the documents it sends readers to."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_LEVEL = ("powerinfer/", "benchmarks/", "tests/", "docs/", "scripts/")


def named_files(text: str) -> set[str]:
    links = {target for target in re.findall(r"\]\(([^)#\s]+)", text) if not re.match(r"[a-z]+:", target)}
    quoted = set(re.findall(r"[`(\s]((?:" + "|".join(TOP_LEVEL) + r")[\w./-]*\w)", text))
    documents = set(re.findall(r"\b([A-Z][A-Za-z_-]*\.md)\b", text))  # README.md, DESIGN.md: ours or nothing
    return links | quoted | documents


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_documents_name_only_files_that_exist(document):
    missing = sorted(name for name in named_files(document.read_text())
                     if not (document.parent / name).exists() and not (ROOT / name).exists()
                     and not any((ROOT / top / name).exists() for top in ("docs", "powerinfer")))
    assert not missing, f"{document.name} names files that are not in the repository: {missing}"
