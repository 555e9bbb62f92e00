"""The README's install path works: ``python -m build`` makes a wheel that installs and runs.

The build runs on a copy of the tracked files (so nothing is written into the clone),
without build isolation (the machine may have no package index; the venv's setuptools
is the one ``pyproject.toml`` asks for). The wheel is installed with ``--no-deps`` into a
folder that is put first on ``sys.path``: the dependencies come from the venv, omnilink
from the wheel.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import omnilink

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_wheel_builds_installs_and_runs(tmp_path):
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
    wheels = list(dist.glob("omnilink-*-py3-none-any.whl"))
    assert len(wheels) == 1 and list(dist.glob("omnilink-*.tar.gz")), sorted(p.name for p in dist.iterdir())
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "omnilink/py.typed" in names and "omnilink/connectors/shm/connector.py" in names
    assert not any(n.startswith(("tests/", "examples/", "benchmarks/")) for n in names)
    entry_points = zipfile.ZipFile(wheels[0]).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "omnilink = omnilink.__main__:main" in entry_points
    assert "[vllm_omni.general_plugins]" in entry_points and "[omnilink.connectors]" in entry_points

    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--target", str(site), str(wheels[0])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import omnilink, sys; print(omnilink.__file__); "
            "from omnilink.cli import main; sys.exit(main(['--version']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    where, version = r.stdout.splitlines()
    assert where.startswith(str(site)) and version == f"omnilink {omnilink.__version__}"
