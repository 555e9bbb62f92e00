"""The project stands alone: nothing it ships or runs cites design notes kept outside it."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
# Files a user or a contributor reads: the package, docs, build and CI files, tests, examples.
GLOBS = ("omnilink/**/*.py", "tests/**/*.py", "examples/**/*", "benchmarks/**/*.py", "benchmarks/**/*.md",
         "benchmarks/**/*.sh", "*.md", "docs/**/*.md", "mkdocs.yml", "Makefile", "pyproject.toml", ".ci/*")
# Case-sensitive: the notes' names as words (``FLAG_BY_REFERENCE`` is not one).
OUTSIDE = re.compile(r"\b(REFERENCE|DESIGN|STYLE)(\.md)?\b|\.\./shared/")


def test_no_citation_of_files_outside_the_repository():
    offenders = []
    for pattern in GLOBS:
        for path in REPO.glob(pattern):
            if not path.is_file() or path == pathlib.Path(__file__):
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if OUTSIDE.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "cite the project's own docs instead:\n" + "\n".join(offenders)
