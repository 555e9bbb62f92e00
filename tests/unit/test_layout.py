"""The package layout keeps its doors: no module reaches into another package's internals.

Rules, checked on the AST of every module under ``omnilink/``:

1. An import of a *module* (a file, not a package) is allowed only from modules of its
   own package or of a package below it: ``omnilink.connectors.shm.segments`` may be
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
    # The rule must be able to fail: plant an import of shm's segment layouts in the root package.
    planted = ROOT / "_layout_probe_tmp.py"
    planted.write_text("from omnilink.connectors.shm.segments import Channel\n"
                       "from omnilink.connectors import shm\nfrom omnilink.connectors.shm import _x\n")
    try:
        bad = offenders()
    finally:
        planted.unlink()
    assert any("_layout_probe_tmp.py:1: imports module omnilink.connectors.shm.segments" in b for b in bad)
    assert any("_layout_probe_tmp.py:3: imports private _x" in b for b in bad)
    assert not any("_layout_probe_tmp.py:2" in b for b in bad)


def test_packages_import_and_document_themselves():
    code = ("import omnilink, omnilink.chunking, omnilink.cuda, omnilink.connectors.shm, "
            "omnilink.connectors.shmem, omnilink.connectors.devpool, omnilink.connectors.cuda_ipc, "
            "omnilink.connectors.zmq, omnilink.connectors.nccl, omnilink.integrations.vllm_omni")
    subprocess.run([sys.executable, "-c", code], check=True)
    for name in ("omnilink.chunking", "omnilink.cuda", "omnilink.connectors", "omnilink.connectors.shm",
                 "omnilink.connectors.shmem", "omnilink.connectors.devpool", "omnilink.connectors.cuda_ipc",
                 "omnilink.connectors.zmq", "omnilink.connectors.nccl", "omnilink.integrations.vllm_omni",
                 "omnilink._bench", "omnilink._bench.scenarios"):
        pkg = importlib.import_module(name)
        assert pkg.__doc__ and len(pkg.__doc__.strip().splitlines()) >= 3, f"{name} has no docstring"


def test_no_prefix_files_left():
    flat = [p.name for p in ROOT.glob("_chunking_*.py")]
    flat += [p.name for p in (ROOT / "connectors").glob("_*_*.py") if p.name != "__init__.py"]
    assert not flat, f"files grouped by a name prefix instead of a package: {flat}"


# ------------------------------------------------- no circle between the two transports
def _imported(path: pathlib.Path) -> set[str]:
    """Every ``omnilink`` module or package a file imports, anywhere in it (function-level
    imports included): ``from P import n`` counts as ``P`` and ``P.n``."""
    mod = _module_name(path)
    home = _home_package(path, mod)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = home.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in out if n.startswith("omnilink")}


def _under(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def circle_offenders() -> list[str]:
    """The imports that would bring back a circle between ``connectors/shm`` and
    ``connectors/cuda_ipc``: shm may not import cuda_ipc; the device pool (``devpool``)
    and the shared-memory primitives (``shmem``) below them import neither, and
    ``shmem`` not the device pool either."""
    rules = {
        "omnilink.connectors.shm": ("omnilink.connectors.cuda_ipc",),
        "omnilink.connectors.devpool": ("omnilink.connectors.shm", "omnilink.connectors.cuda_ipc"),
        "omnilink.connectors.shmem": ("omnilink.connectors.shm", "omnilink.connectors.cuda_ipc",
                                      "omnilink.connectors.devpool"),
    }
    found = []
    for pkg, banned in rules.items():
        for path in sorted((ROOT.parent / pathlib.Path(*pkg.split("."))).rglob("*.py")):
            for name in sorted(_imported(path)):
                if any(_under(name, b) for b in banned):
                    found.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    return found


def test_shm_and_cuda_ipc_import_no_circle():
    bad = circle_offenders()
    assert not bad, "an import circle between the transports is back:\n" + "\n".join(bad)


def test_circle_check_catches_a_planted_import():
    planted = ROOT / "connectors" / "shm" / "_circle_probe_tmp.py"
    planted.write_text("def f():\n    from omnilink.connectors import cuda_ipc\n")
    try:
        bad = circle_offenders()
    finally:
        planted.unlink()
    assert any("_circle_probe_tmp.py imports omnilink.connectors.cuda_ipc" in b for b in bad)


def test_importing_the_device_pool_loads_neither_connector():
    # What the AST check cannot see (an import through a name built at run time) shows
    # in sys.modules: the device pool and shmem load no connector package, and shm loads
    # no cuda_ipc.
    code = (
        "import sys\n"
        "import omnilink.connectors.devpool, omnilink.connectors.shmem\n"
        "bad = [m for m in sys.modules if m == 'omnilink.connectors.shm' or m.startswith(\n"
        "       ('omnilink.connectors.shm.', 'omnilink.connectors.cuda_ipc'))]\n"
        "assert not bad, bad\n"
        "import omnilink.connectors.shm\n"
        "bad = [m for m in sys.modules if m.startswith('omnilink.connectors.cuda_ipc')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
