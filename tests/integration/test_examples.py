"""Every program in examples/ runs to completion in a subprocess (cuda.core style).

An example whose banner says ``Requires: CUDA`` is skipped, with that reason, where no
GPU is present.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


def _needs_cuda(path: pathlib.Path) -> bool:
    return "Requires: CUDA" in path.read_text().split('"""')[1] if '"""' in path.read_text() else False


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    if _needs_cuda(path):
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"{path.name} needs a CUDA device; none is present")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(path.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, f"{path.name} failed:\n{r.stdout}\n{r.stderr}"
