"""``omnilink info`` for a deployment: the vLLM-Omni plugin and ``VLLM_PLUGINS``, the
versions a deployment must match, and a ``/dev/shm`` smaller than the default arena."""

from __future__ import annotations

import json

import pytest

from omnilink import cli
from omnilink.cli import main
from omnilink.integrations.vllm_omni.config import plugin_status

ENTRY = "omnilink = omnilink.integrations.vllm_omni:register"


@pytest.mark.parametrize(
    "value, loads, says",
    [
        (None, True, "VLLM_PLUGINS is unset"),
        ("omnilink", True, "names 'omnilink'"),
        ("lora_resolver,omnilink", True, "names 'omnilink'"),
        ("lora_resolver", False, "VLLM_PLUGINS=lora_resolver,omnilink"),
        ("", False, "VLLM_PLUGINS=omnilink"),  # an empty list loads no plugin at all
        ("lora_resolver, omnilink", False, "write 'lora_resolver,omnilink'"),  # vLLM does not strip
    ],
)
def test_plugin_status_follows_vllm_plugins(value, loads, says):
    env = {} if value is None else {"VLLM_PLUGINS": value}
    status = plugin_status(env)
    assert status["entry_point"] == ENTRY  # pyproject.toml's vllm_omni.general_plugins
    assert status["loads"] is loads and status["vllm_plugins"] == value
    assert says in status["reason"], status["reason"]


def test_info_reports_plugin_versions_and_a_small_dev_shm(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    monkeypatch.setattr("omnilink._bench.shm_usage", lambda: {"size_bytes": 64 << 20, "free_bytes": 60 << 20})
    assert main(["info", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert {"cuda-python", "vllm", "vllm-omni"} <= set(rec["versions"])
    assert rec["versions"]["vllm-omni"] == "0.30.0"  # make setup installs it
    assert rec["vllm_omni_plugin"]["entry_point"] == ENTRY and rec["vllm_omni_plugin"]["loads"] is False
    assert rec["backends"]["shm"].startswith("ok, but /dev/shm is small")
    assert len(rec["warnings"]) == 1 and "less than the default 128 MiB arena" in rec["warnings"][0]
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"vLLM-Omni plugin: {ENTRY}" in out and "does NOT load: VLLM_PLUGINS='other'" in out
    assert "warning: /dev/shm has 60.0 MiB free" in out and "start at 15 MiB" in out


def test_info_has_no_warning_where_dev_shm_is_large(monkeypatch):
    assert cli._shm_warnings({"size_bytes": 1 << 34, "free_bytes": 1 << 33}) == []
    assert "not present" in cli._shm_warnings(None)[0]
