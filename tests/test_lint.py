"""The repository's own rules: ruff's checks (pyproject.toml's [tool.ruff]), and test modules that
share helpers through tests/helpers.py and conftest.py rather than by importing one another."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_passes():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: scripts/setup.sh installs it with the test extra")
    result = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_test_modules_do_not_import_each_other():
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}:{node.lineno} imports {name}" for name in names
                          if name.split(".")[0].startswith("test_")]
    assert not offenders, "\n".join(offenders)


# a repository path in prose: README.md and docs/ name files as `powerinfer/...`, `docs/...`, etc.
REPOSITORY_PATH = re.compile(r"(?<![\w./~-])((?:\.\./)?(?:powerinfer|tests|benchmarks|docs|scripts|\.ci)/[\w./-]*\w)")


# markdown links, and documents sent to by name (README.md; DESIGN.md is not in the repository)
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s:]+)\)")
DOCUMENT_NAME = re.compile(r"\b([A-Z][A-Za-z_-]*\.md)\b")


def test_documents_name_files_that_exist():
    documents = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")]
    missing = [f"{document.relative_to(ROOT)}: {path}" for document in documents
               for pattern in (REPOSITORY_PATH, MARKDOWN_LINK, DOCUMENT_NAME)
               for path in pattern.findall(document.read_text())
               if not any((folder / path).exists() for folder in (ROOT, document.parent, ROOT / "docs"))]
    assert not missing, "\n".join(missing)
