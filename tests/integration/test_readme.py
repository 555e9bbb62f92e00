"""README and docs code runs as written, and type-checks with ``mypy --strict`` with ``examples/``.

Every ```python block of README.md and of ``docs/**/*.md`` is run as its own program in a
fresh interpreter from the repository root (a block that appears on several pages runs
once). Markers on the line before a block:

- ``<!-- readme-test: vllm-omni -->``: the block needs vLLM-Omni: it runs after the
  connector modules of the installed ``vllm-omni`` wheel are loaded without vLLM
  (``tests/integration/_vllm_omni_stubs.py``), as in a vLLM-Omni process.
- ``<!-- readme-skip: REASON -->``: the block is not run here, for the reason given
  (it needs a GPU or a second host); it is still type-checked.
- ``<!-- readme-include: PATH -->`` (YAML): the block must be PATH, character for
  character, so the file the tests feed to vLLM-Omni is what users read.
- ``<!-- readme-excerpt: PATH -->`` (YAML): every line of the block is a line of PATH,
  in the file's order, so an excerpt cannot drift from the file.

Every YAML block carries one of the last two markers. Console blocks are not run: they
install packages or start long benchmarks.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
_FENCE = re.compile(r"(?:<!-- (readme-[a-z]+): ([^>]*?) -->\n)?```(\w+)\n(.*?)```", re.S)
_STUBS = "from tests.integration._vllm_omni_stubs import install as _install\n_install()\n"


def _page_blocks(page: pathlib.Path, lang: str) -> list[tuple[str, str, str, str]]:
    """(where, marker kind, marker value, code) of every ``lang`` block of one page."""
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        if m.group(3) == lang:
            line = text.count("\n", 0, m.start(3)) + 1
            # Fences indented inside an admonition: the code is dedented as Markdown does.
            code = textwrap.dedent(m.group(4))
            out.append((f"{os.path.relpath(page, REPO)}:{line}", m.group(1) or "", (m.group(2) or "").strip(), code))
    return out


def _blocks(lang: str, pages: list[pathlib.Path] = PAGES) -> list[tuple[str, str, str, str]]:
    """Every ``lang`` block of README and docs, each distinct code once (its first place)."""
    seen: set[str] = set()
    out = []
    for page in pages:
        for block in _page_blocks(page, lang):
            if block[3] not in seen:
                seen.add(block[3])
                out.append(block)
    return out


PY_BLOCKS = _blocks("python")
README_PY_BLOCKS = _page_blocks(README, "python")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_readme_and_docs_have_the_blocks_this_file_expects():
    # README: the two-process quickstart. Docs: that quickstart, use, put_many, asyncio,
    # zmq (CURVE), nccl, cuda_ipc, memory, testing, streaming, GPU, device IPC and the two
    # vLLM-Omni blocks.
    assert len(README_PY_BLOCKS) >= 1 and "spawn" in README_PY_BLOCKS[0][3]
    assert len(PY_BLOCKS) >= 14
    assert sum(kind == "readme-test" for _, kind, _, _ in PY_BLOCKS) == 2
    assert any("curve_keypair" in code for *_, code in PY_BLOCKS)
    for where, kind, value, _ in _blocks("python"):
        assert kind in ("", "readme-test", "readme-skip"), f"{where}: unknown marker {kind!r}"
        assert kind != "readme-skip" or value, f"{where}: readme-skip needs a reason"


def test_block_collection_sees_markers_indents_and_duplicates(tmp_path):
    # The collector itself: a page with a duplicate block, an indented block and a marker.
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n    ```python\n    y = 2\n    ```\n\n"
                    "<!-- readme-skip: needs a GPU -->\n```python\nz = 3\n```\n```python\nx = 1\n```\n")
    got = [(kind, value, code) for _, kind, value, code in _blocks("python", [page, page])]
    assert got == [("", "", "x = 1\n"), ("", "", "y = 2\n"), ("readme-skip", "needs a GPU", "z = 3\n")]


@pytest.mark.parametrize("block", PY_BLOCKS, ids=[b[0] for b in PY_BLOCKS])
def test_readme_python_block_runs(block, tmp_path):
    line, kind, value, code = block
    prelude = ""
    if kind == "readme-skip":
        pytest.skip(f"{line}: {value}")
    if kind == "readme-test":
        assert value == "vllm-omni", f"unknown readme-test marker {value!r} at {line}"
        from tests.integration import _vllm_omni_stubs as stubs

        if stubs.vllm_omni_root() is None:
            pytest.skip(f"vllm-omni is not installed; run `{stubs.PIP_HINT}`")
        prelude = _STUBS
    script = tmp_path / "block.py"
    script.write_text(prelude + code)
    r = subprocess.run([sys.executable, str(script)], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, f"block at {line} failed:\n{code}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    # Runs as written: no warning of the library's own (e.g. zmq without CURVE).
    assert "WARNING" not in r.stderr and "Warning" not in r.stderr, r.stderr


def test_yaml_blocks_are_the_files_or_excerpts_of_them():
    blocks = [b for page in PAGES for b in _page_blocks(page, "yaml")]
    assert any(kind == "readme-include" for _, kind, _, _ in blocks), \
        "the vLLM-Omni config in the docs must come from a file under examples/"
    for where, kind, path, code in blocks:
        assert kind in ("readme-include", "readme-excerpt"), f"{where}: a YAML block must name its file"
        text = (REPO / path).read_text()
        if kind == "readme-include":
            assert text == code, f"{where} differs from {path}"
        else:
            assert _is_excerpt(code, text), f"{where}: not an excerpt of {path} (lines missing or reordered)"


def _is_excerpt(code: str, text: str) -> bool:
    lines = iter(text.splitlines())
    return all(any(want == have for have in lines) for want in code.splitlines())


def test_excerpt_check_rejects_edits_and_reordering():
    text = "a: 1\nb:\n  c: 2\nd: 3\n"
    assert _is_excerpt("a: 1\n  c: 2\n", text)
    assert not _is_excerpt("a: 1\n  c: 3\n", text)
    assert not _is_excerpt("d: 3\na: 1\n", text)


MYPY_INI = textwrap.dedent(
    """\
    [mypy]
    strict = True
    # omnilink itself is checked through its annotations (follow_imports=silent: errors
    # are reported for the examples and README blocks, not for the library's internals)
    follow_imports = silent
    warn_unused_configs = True

    [mypy-vllm_omni.*]
    follow_imports = skip
    ignore_missing_imports = True
    """
)


def test_examples_and_readme_blocks_pass_mypy_strict(tmp_path):
    files = sorted(str(p) for p in (REPO / "examples").glob("*.py"))
    blocks = tmp_path / "readme_blocks"
    blocks.mkdir()
    for n, (_where, _kind, _value, code) in enumerate(PY_BLOCKS):
        path = blocks / f"block{n:02d}.py"
        path.write_text(code)
        files.append(str(path))
    ini = tmp_path / "mypy.ini"
    ini.write_text(MYPY_INI)
    cache = REPO / ".mypy_cache"
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ini), "--cache-dir", str(cache),
         "--no-error-summary", *files],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, f"mypy --strict failed:\n{r.stdout}\n{r.stderr}"
