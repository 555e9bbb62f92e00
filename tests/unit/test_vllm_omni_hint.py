"""What ``register()`` says when vLLM-Omni cannot be imported, in each of the three cases.

The venv ``make setup`` builds has vLLM-Omni installed with ``--no-deps``: its connector
modules are there but its package ``__init__`` needs dependencies that are not
(``aenum`` first). The hint must say that, not "pip install --no-deps vllm-omni" again.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from importlib import metadata

import pytest

from omnilink.integrations.vllm_omni import config as vconfig


def _fake_installed(monkeypatch, version):
    def fake_version(name):
        if version is None:
            raise metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(metadata, "version", fake_version)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if version is None else object())


def test_not_installed(monkeypatch):
    _fake_installed(monkeypatch, None)
    exc = ModuleNotFoundError("No module named 'vllm_omni'", name="vllm_omni")
    text = vconfig.import_failure(exc)
    assert "not installed" in text and "pip install vllm-omni" in text and "--no-deps" not in text


def test_installed_without_its_dependencies(monkeypatch):
    _fake_installed(monkeypatch, "0.30.0")
    text = vconfig.import_failure(ModuleNotFoundError("No module named 'aenum'", name="aenum"))
    assert "partly importable" in text and "'aenum'" in text
    assert "pip install vllm-omni==0.30.0, without --no-deps" in text
    assert "not installed" not in text


def test_broken_install_of_vllm_omni_itself(monkeypatch):
    _fake_installed(monkeypatch, "0.30.0")
    exc = ModuleNotFoundError("No module named 'vllm_omni.distributed'", name="vllm_omni.distributed")
    text = vconfig.import_failure(exc)
    assert "incomplete" in text and "--force-reinstall --no-deps vllm-omni==0.30.0" in text


def test_register_in_a_partial_install_names_the_missing_dependency():
    # A fresh interpreter: the other tests' stubs must not make vLLM-Omni importable.
    code = (
        "from omnilink.integrations.vllm_omni import register\n"
        "try:\n    register()\nexcept Exception as exc:\n"
        "    print(type(exc).__name__); print(exc)\nelse:\n    print('registered')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, _, message = proc.stdout.partition("\n")
    if first == "registered":
        pytest.skip("vLLM-Omni imports in full here: no partial install to report")
    try:
        metadata.version("vllm-omni")
    except metadata.PackageNotFoundError:
        assert first == "ConfigurationError" and "not installed" in message
        return
    assert first == "ConfigurationError", proc.stdout
    assert "partly importable" in message and "without --no-deps" in message, message
