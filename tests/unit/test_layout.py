"""The package layout keeps its doors: no module reaches into another package's internals.

Rules, checked on the AST of every module under ``omnilink/``:

1. An import of a *module* (a file, not a package) is allowed only from modules of its
   own package or of a package below it: ``omnilink.connectors.shm.alloc`` may be
   imported inside ``omnilink.connectors.shm`` only; everyone else goes through
   ``omnilink.connectors.shm``. Top-level modules (``omnilink.blob``,
   ``omnilink._errors``) belong to the root package, so everyone may import them.
2. An underscored name (``from P import _x``) may be imported only from a package ``P``
   that contains the importing module.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import omnilink

ROOT = pathlib.Path(omnilink.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(mod: str) -> bool:
    rel = pathlib.Path(*mod.split("."))
    return (ROOT.parent / rel / "__init__.py").exists()


def _is_module_file(mod: str) -> bool:
    return (ROOT.parent / pathlib.Path(*mod.split("."))).with_suffix(".py").exists()


def _home_package(path: pathlib.Path, mod: str) -> str:
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


def _inside(pkg: str, importer_pkg: str) -> bool:
    return importer_pkg == pkg or importer_pkg.startswith(pkg + ".")


def offenders() -> list[str]:
    found: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = _module_name(path)
        home = _home_package(path, mod)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[tuple[str, list[str]]] = []
            if isinstance(node, ast.Import):
                targets = [(a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [(node.module, [a.name for a in node.names])]
            for target, names in targets:
                if not target.startswith("omnilink"):
                    continue
                where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
                if _is_module_file(target) and not _is_package(target):
                    owner = target.rpartition(".")[0]
                    if not _inside(owner, home):
                        found.append(f"{where}: imports module {target} from outside {owner}")
                if _is_package(target):
                    for name in names:
                        sub = f"{target}.{name}"
                        if _is_module_file(sub) and not _inside(target, home):
                            found.append(f"{where}: imports module {sub} from outside {target}")
                        elif name.startswith("_") and not _inside(target, home):
                            found.append(f"{where}: imports private {name} of {target}")
                elif names:
                    owner = target.rpartition(".")[0]
                    for name in names:
                        if name.startswith("_") and not _inside(owner, home):
                            found.append(f"{where}: imports private {name} of {target}")
    return found


def test_no_module_reaches_into_another_package():
    bad = offenders()
    assert not bad, "imports past a package's door:\n" + "\n".join(bad)


def test_checker_catches_a_planted_offender(tmp_path, monkeypatch):
    # The rule must be able to fail: plant an import of shm's allocator in the CLI's package.
    planted = ROOT / "_layout_probe_tmp.py"
    planted.write_text("from omnilink.connectors.shm.alloc import Allocator\n"
                       "from omnilink.connectors import shm\nfrom omnilink.connectors.shm import _x\n")
    try:
        bad = offenders()
    finally:
        planted.unlink()
    assert any("_layout_probe_tmp.py:1: imports module omnilink.connectors.shm.alloc" in b for b in bad)
    assert any("_layout_probe_tmp.py:3: imports private _x" in b for b in bad)
    assert not any("_layout_probe_tmp.py:2" in b for b in bad)


def test_packages_import_and_document_themselves():
    code = ("import omnilink, omnilink.chunking, omnilink.cuda, omnilink.connectors.shm, "
            "omnilink.connectors.zmq, omnilink.connectors.nccl, omnilink.integrations.vllm_omni")
    subprocess.run([sys.executable, "-c", code], check=True)
    for name in ("omnilink.chunking", "omnilink.cuda", "omnilink.connectors", "omnilink.connectors.shm",
                 "omnilink.connectors.zmq", "omnilink.connectors.nccl", "omnilink.integrations.vllm_omni",
                 "omnilink._bench", "omnilink._bench.scenarios"):
        pkg = importlib.import_module(name)
        assert pkg.__doc__ and len(pkg.__doc__.strip().splitlines()) >= 3, f"{name} has no docstring"


def test_no_prefix_files_left():
    flat = [p.name for p in ROOT.glob("_chunking_*.py")]
    flat += [p.name for p in (ROOT / "connectors").glob("_*_*.py") if p.name != "__init__.py"]
    assert not flat, f"files grouped by a name prefix instead of a package: {flat}"
