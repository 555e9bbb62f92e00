"""README code runs as written, and type-checks with ``mypy --strict`` with ``examples/``.

Every ```python block of README.md is run as its own program in a fresh interpreter from
the repository root. A block preceded by ``<!-- readme-test: vllm-omni -->`` needs
vLLM-Omni: it runs after the connector modules of the installed ``vllm-omni`` wheel
are loaded without vLLM (``tests/integration/_vllm_omni_stubs.py``), as in a vLLM-Omni
process. A YAML block preceded by ``<!-- readme-include: PATH -->`` must be PATH,
character for character, so the file the tests feed to vLLM-Omni is what users read.
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
_FENCE = re.compile(r"(?:<!-- (readme-[a-z]+): ([^>]*?) -->\n)?```(\w+)\n(.*?)```", re.S)
_STUBS = "from tests.integration._vllm_omni_stubs import install as _install\n_install()\n"


def _blocks(lang: str) -> list[tuple[int, str, str, str]]:
    """(line, marker kind, marker value, code) of every ``lang`` block of README."""
    text = README.read_text()
    out = []
    for m in _FENCE.finditer(text):
        if m.group(3) == lang:
            line = text.count("\n", 0, m.start(3)) + 1
            out.append((line, m.group(1) or "", (m.group(2) or "").strip(), m.group(4)))
    return out


PY_BLOCKS = _blocks("python")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_readme_has_the_blocks_this_file_expects():
    # Use, zmq (CURVE), nccl, memory, testing, streaming, the two vLLM-Omni blocks.
    assert len(PY_BLOCKS) >= 8
    assert sum(kind == "readme-test" for _, kind, _, _ in PY_BLOCKS) == 2
    assert any("curve_keypair" in code for *_, code in PY_BLOCKS)


@pytest.mark.parametrize("block", PY_BLOCKS, ids=[f"line{b[0]}" for b in PY_BLOCKS])
def test_readme_python_block_runs(block, tmp_path):
    line, kind, value, code = block
    prelude = ""
    if kind == "readme-test":
        assert value == "vllm-omni", f"unknown readme-test marker {value!r} at README line {line}"
        from tests.integration import _vllm_omni_stubs as stubs

        if stubs.vllm_omni_root() is None:
            pytest.skip(f"vllm-omni is not installed; run `{stubs.PIP_HINT}`")
        prelude = _STUBS
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(prelude + code)
    r = subprocess.run([sys.executable, str(script)], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, f"README block at line {line} failed:\n{code}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    # Runs as written: no warning of the library's own (e.g. zmq without CURVE).
    assert "WARNING" not in r.stderr and "Warning" not in r.stderr, r.stderr


def test_readme_yaml_includes_are_the_files():
    includes = [(line, value, code) for line, kind, value, code in _blocks("yaml") if kind == "readme-include"]
    assert includes, "the vLLM-Omni config in README must come from a file under examples/"
    for line, path, code in includes:
        assert (REPO / path).read_text() == code, f"README line {line} differs from {path}"


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
    for line, _kind, _value, code in PY_BLOCKS:
        path = blocks / f"readme_line{line}.py"
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
