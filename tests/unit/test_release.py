"""What a release promises: its distribution name, licence, version, changelog, docs and figures.

- No file of the project tells users to install a distribution named ``omnilink``: that
  name on PyPI belongs to an unrelated project. Ours is ``pyomnilink``.
- ``LICENSE`` is the Apache-2.0 text; ``pyproject.toml`` states it in SPDX form.
- The version is single-sourced (``omnilink.__version__``) and has a CHANGELOG entry in
  Keep a Changelog form, with no benchmark figures (they live on the performance page).
- The README stays short; the dependency bounds and the compatibility table agree.
- The docs build with warnings as errors; the performance page and the README's headline
  table are what ``benchmarks/make_perf_page.py`` renders from committed result files,
  and every result file kept is one a page cites.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

import omnilink

REPO = pathlib.Path(__file__).resolve().parents[2]
DIST = "pyomnilink"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# `pip install omnilink`, `pip install "omnilink[cuda]"`, `pip install -U omnilink==0.1`,
# `uv pip install 'omnilink[plot]'`, `pip download omnilink`, ...: an install command whose
# argument is the bare distribution name (optionally with extras or a version).
_INSTALL = re.compile(
    r"\b(?:pip3?|pipx|uv\s+pip|python3?\s+-m\s+pip)\s+(?:install|download)\b[^\n`]*?"
    r"(?<![\w./:@-])[\"']?omnilink(?:\[[^\]\n]*\])?(?:\s*[<>=!~]=?\s*[\w.*]+)?[\"']?(?=$|[\s`)\"',;])",
    re.M,
)


def _tracked_text_files() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    files = []
    for name in filter(None, out.decode().split("\0")):
        path = REPO / name
        if path.is_file() and path.suffix not in {".png", ".jsonl", ".json"}:
            files.append(path)
    return files


def install_lines_naming_omnilink(text: str) -> list[str]:
    return [m.group(0) for m in _INSTALL.finditer(text)]


def test_install_scanner_catches_the_forms_users_copy():
    bad = ["pip install " + "omnilink", 'pip install "' + "omnilink[cuda]" + '"',
           "pip install '" + "omnilink[cuda]' (cuda-python)", "python -m pip install -U " + "omnilink==0.1.0",
           "uv pip install " + "omnilink>=0.1", "`pip install " + "omnilink`", "pip download --no-deps " + "omnilink"]
    good = ["pip install pyomnilink", 'pip install "pyomnilink[cuda]"', "pip install -e .",
            "pip install --no-deps vllm-omni==0.30.0", "pip install dist/omnilink-0.1.0.whl",
            "pip install ./omnilink", "pip install omnilink-tools", "the omnilink package"]
    for line in bad:
        assert install_lines_naming_omnilink(line), line
    for line in good:
        assert not install_lines_naming_omnilink(line), line


def test_no_file_tells_users_to_install_the_other_projects_name():
    offenders = []
    for path in _tracked_text_files():
        if path == pathlib.Path(__file__):
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{path.relative_to(REPO)}: {hit}" for hit in install_lines_naming_omnilink(text)]
    assert not offenders, f"the distribution is {DIST}; `omnilink` on PyPI is another project:\n" + "\n".join(offenders)


def test_install_hints_in_the_library_name_the_distribution():
    from omnilink.cuda import CUDA_INSTALL_HINT

    assert f"{DIST}[cuda]" in CUDA_INSTALL_HINT
    assert PYPROJECT["project"]["name"] == DIST


def test_licence_file_and_spdx_metadata():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project["classifiers"]), "PEP 639: no licence classifiers"
    assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(project["urls"])
    assert project["requires-python"].startswith(">=")


def test_version_is_single_sourced_and_released():
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "omnilink.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", omnilink.__version__), omnilink.__version__


_SECTIONS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
# A figure: a number with a unit of time, rate or size, or a speed-up ratio.
_FIGURE = re.compile(r"\b\d[\d.,]*\s*(?:us|µs|ms|s|GB/s|MB/s|GiB|MiB|KiB|%|x)(?![\w/])")


def test_changelog_keeps_a_changelog_without_figures():
    text = (REPO / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, re.M)
    assert releases and releases[0] == ("Unreleased", ""), "the first section is ## [Unreleased]"
    assert (omnilink.__version__, releases[1][1]) == releases[1] and releases[1][1], \
        f"## [{omnilink.__version__}] - YYYY-MM-DD must follow [Unreleased]"
    for heading in re.findall(r"^#{2,}\s.*$", text, re.M):
        if heading.startswith("### "):
            assert heading[4:] in _SECTIONS, heading
        else:
            assert re.fullmatch(r"## \[[^\]]+\](?: - \d{4}-\d{2}-\d{2})?", heading), heading
    figures = [line for line in text.splitlines() if _FIGURE.search(line)]
    assert not figures, "figures belong on docs/performance.md:\n" + "\n".join(figures)


def test_changelog_figure_check_can_fail():
    for line in ("- shm 4 KiB one-way 147 us", "- 12.4 GB/s", "- 5.4x faster", "- 3.3 % of step time"):
        assert _FIGURE.search(line), line
    assert not _FIGURE.search("- `put_many` / `get_many` for batches; Python 3.10 or later")


def test_readme_is_short_and_undated():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated narrative belongs in git history"
    assert f"pip install {DIST}" in text and "download.pytorch.org/whl/cpu" in text


def _spec(requirement: str) -> str:
    return ", ".join(re.sub(r"([<>=!~]+)", r"\1 ", part).strip() for part in requirement.split(","))


def test_compatibility_table_states_the_metadata_bounds():
    page = (REPO / "docs" / "getting-started.md").read_text()
    deps = {re.split(r"[<>=!~\[]", d)[0]: d for d in PYPROJECT["project"]["dependencies"]}
    torch_bound = _spec(deps["torch"][len("torch"):])
    assert torch_bound.startswith(">= ") and "<" in torch_bound, "torch is bounded on both sides"
    row = next(line for line in page.splitlines() if line.startswith("| torch |"))
    assert torch_bound in row, (torch_bound, row)
    (vllm,) = PYPROJECT["project"]["optional-dependencies"]["vllm-omni"]
    assert vllm.startswith("vllm-omni>=0.30.0,<0.31") and "| vLLM-Omni | 0.30.0" in page


def test_docs_build_with_warnings_as_errors(tmp_path):
    mkdocs = shutil.which("mkdocs", path=os.path.dirname(sys.executable)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.fail("mkdocs is missing: `make setup` installs the docs extra")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("omnilink.connect", "omnilink.decode", "omnilink.TransferTimeout", "omnilink.WouldBlock",
                 "omnilink.connectors.shm.ShmConnector", "omnilink.chunking.ChunkSender", "omnilink.testing.check_connector"):
        assert f'id="{name}"' in api, f"API reference lacks {name}"
    nav = (REPO / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert pages == set(re.findall(r":\s+([\w/.-]+\.md)$", nav, re.M)), "every page is in the nav, and only those"


def _perf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "make_perf_page.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_performance_page_matches_the_committed_results(tmp_path):
    r = _perf("--check")
    assert r.returncode == 0, r.stderr
    # The check fails when a figure on a page is edited by hand.
    for page in ("docs/performance.md", "README.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / page, tmp_path / page)
    perf = tmp_path / "docs" / "performance.md"
    text = perf.read_text()
    edited = re.sub(r"\| omnilink-shm \| [\d.]+", "| omnilink-shm | 0.01", text, count=1)
    assert edited != text
    perf.write_text(edited)
    r = _perf("--check", "--root", str(tmp_path))
    assert r.returncode == 1 and "docs/performance.md" in r.stderr, r.stderr


def test_every_result_file_kept_is_cited():
    blocks = (REPO / "docs" / "performance.md").read_text() + (REPO / "README.md").read_text()
    cited = set(re.findall(r"benchmarks/results/([\w.-]+)\.jsonl?\b", blocks)) - {"latest"}  # make bench's own
    out = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    stems = {pathlib.Path(name).name.split(".")[0] for name in out}
    assert stems == cited, f"uncited: {sorted(stems - cited)}; missing: {sorted(cited - stems)}"
    assert not any(re.search(r"20\d\d-\d\d-\d\d", name) for name in out), "name results by scenario and machine"


def test_error_tree_in_the_docs_is_the_modules():
    import textwrap

    from omnilink import _errors

    doc = _errors.__doc__ or ""
    tree = textwrap.dedent(doc[doc.index("    OmnilinkError"):]).strip()
    assert tree in (REPO / "docs" / "concepts.md").read_text(), "copy omnilink/_errors.py's tree into concepts.md"
