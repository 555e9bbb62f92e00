"""The release artefacts: sdist and wheel build, pass ``twine check``, and the wheel installs and runs.

The build runs on a copy of the tracked files (so nothing is written into the clone),
without build isolation (the machine may have no package index; the venv's setuptools
is the one ``pyproject.toml`` asks for).

The wheel then goes into a **fresh venv** and is imported there. That venv must never
download a dependency (on a CPU machine a plain ``torch`` requirement pulls a 5.5 GB CUDA
build), so the wheel is installed with ``--no-deps --no-index``, and the venv sees the
dependencies already installed for the tests through one path line (a ``.pth`` entry
appended after the venv's own site-packages). A path line is not a site directory: the
``.pth`` files in it, among them the clone's editable install of omnilink, are not run,
so ``import omnilink`` can only find the wheel's copy. That the versions it sees satisfy
the wheel's ``Requires-Dist`` is checked from the wheel's own metadata.
"""

from __future__ import annotations

import email.parser
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

from packaging.requirements import Requirement

import omnilink

REPO = pathlib.Path(__file__).resolve().parents[2]
DIST = "pyomnilink"


def _build(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    src = tmp_path / "src"
    for name in filter(None, files.decode().split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    # No deprecation of the licence form or anything else the build warns about.
    assert "SetuptoolsDeprecationWarning" not in r.stdout + r.stderr, r.stdout + r.stderr
    wheels = list(dist.glob(f"{DIST}-{omnilink.__version__}-py3-none-any.whl"))
    sdists = list(dist.glob(f"{DIST}-{omnilink.__version__}.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    return wheels[0], sdists[0]


def test_sdist_and_wheel_build_check_install_and_run(tmp_path):
    wheel, sdist = _build(tmp_path)

    # Metadata: what PyPI will show and what twine would refuse.
    r = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    zf = zipfile.ZipFile(wheel)
    names = zf.namelist()
    meta = email.parser.Parser().parsestr(zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    assert meta["Name"] == DIST and meta["Version"] == omnilink.__version__
    assert meta["License-Expression"] == "Apache-2.0" and meta["Metadata-Version"] >= "2.4"
    assert meta["Requires-Python"] and meta.get_all("Project-URL")
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "omnilink/py.typed" in names and "omnilink/connectors/shm/connector.py" in names
    assert not any(n.startswith(("tests/", "examples/", "benchmarks/", "docs/")) for n in names)
    entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "omnilink = omnilink.__main__:main" in entry_points
    assert "[vllm_omni.general_plugins]" in entry_points and "[omnilink.connectors]" in entry_points

    # The dependencies the tests run with satisfy the wheel's own bounds.
    from importlib.metadata import PackageNotFoundError, version

    for req in map(Requirement, meta.get_all("Requires-Dist") or []):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement
        try:
            have = version(req.name)
        except PackageNotFoundError:
            raise AssertionError(f"{req.name} is not installed, the wheel requires {req}") from None
        assert req.specifier.contains(have, prereleases=True), f"{req.name} {have} outside the wheel's {req}"

    # A fresh venv: only the wheel is installed into it.
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    fresh_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path[1:]}
    deps = [d for d in sorted(deps) if d and os.path.isdir(d) and os.path.realpath(d) != str(REPO)]
    pathlib.Path(fresh_site, "_test_deps.pth").write_text("\n".join(deps) + "\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.metadata as m, omnilink, torch, msgspec, zmq, posix_ipc; "
            "from omnilink.connectors import available_backends; "
            f"print(omnilink.__file__); print(m.version('{DIST}')); print(','.join(available_backends()))")
    r = subprocess.run([str(py), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    where, dist_version, backends = r.stdout.splitlines()
    assert where.startswith(fresh_site), f"imported {where}, not the wheel's copy"
    assert dist_version == omnilink.__version__
    assert {"memory", "shm", "zmq"} <= set(backends.split(","))

    # The console script the wheel installs, and a payload through the installed package.
    r = subprocess.run([str(venv / "bin" / "omnilink"), "--version"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"omnilink {omnilink.__version__}", r.stdout + r.stderr
    code = ("import omnilink, torch; x = torch.arange(6).reshape(2, 3); "
            "c = omnilink.connect('memory', channel='smoke'); c.put('k', {'x': x}); "
            "assert torch.equal(c.get('k', timeout=5.0)['x'], x); c.close(); print('ok')")
    r = subprocess.run([str(py), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
