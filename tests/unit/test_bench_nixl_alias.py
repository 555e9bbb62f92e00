"""The benchmarks load vLLM-Omni's ``NixlConnector`` on a machine where only NIXL's CUDA
build is installed (``nixl-cu13``, as on the GPU hosts): ``nixl`` is then that build's,
as the ``nixl`` package makes it."""

import importlib
import sys

import pytest

from omnilink._bench import vllm_omni_shm


def _installed_build():
    for build in vllm_omni_shm._NIXL_BUILDS:
        try:
            importlib.import_module(f"{build}._api")
        except ImportError:
            continue
        return build
    return None


BUILD = _installed_build()
_NIXL_NAMES = ("nixl", "nixl._api", "nixl._bindings")


@pytest.mark.skipif(BUILD is None, reason="no NIXL build (nixl-cu13 / nixl-cu12) is installed")
def test_a_nixl_build_alone_serves_as_nixl(monkeypatch):
    for name in _NIXL_NAMES:
        monkeypatch.setitem(sys.modules, name, None)  # the ``nixl`` package is missing
    api = vllm_omni_shm._nixl_api()
    build_api = importlib.import_module(f"{BUILD}._api")
    bindings = importlib.import_module(f"{BUILD}._bindings")
    assert api is build_api
    import nixl
    from nixl._api import nixl_agent_config

    assert nixl.nixl_agent is build_api.nixl_agent
    # What vLLM-Omni's connector imports from ``nixl``: ``_api``'s name over
    # ``_bindings``'s, as the ``nixl`` package exposes them.
    assert nixl.nixl_thread_sync_t is getattr(build_api, "nixl_thread_sync_t", bindings.nixl_thread_sync_t)
    assert nixl_agent_config is build_api.nixl_agent_config


def test_no_nixl_at_all_is_an_import_error(monkeypatch):
    for name in _NIXL_NAMES + tuple(f"{b}{sub}" for b in vllm_omni_shm._NIXL_BUILDS for sub in ("", "._api", "._bindings")):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError):
        vllm_omni_shm._nixl_api()
    assert sys.modules["nixl"] is None  # nothing was aliased
