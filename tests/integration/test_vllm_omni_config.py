"""The documented vLLM-Omni config, through vLLM-Omni 0.30.0's own config loader.

``examples/vllm_omni/qwen3_omni_omnilink.yaml`` is the YAML ``docs/vllm-omni.md`` shows
and the README excerpts (``tests/integration/test_readme.py`` checks they are the same
text). Fed to vLLM-Omni's real
``load_omni_transfer_config`` (``vllm_omni.distributed.omni_connectors.utils.
initialization``, loaded without vLLM by ``_vllm_omni_stubs``), every stage edge must
resolve to ``OmnilinkConnector``, with the pipeline's edges known or not; and the
connectors vLLM-Omni then builds for each stage carry a payload across the edge. The
shape the README once showed (connectors defined, never referenced by a stage) is
kept as the negative case: vLLM-Omni gives those edges ``SharedMemoryConnector``, which
is how a user "switched" without switching.
"""

from __future__ import annotations

import copy
import importlib
import os
import pathlib

import pytest
import torch
import yaml

from tests.integration import _vllm_omni_stubs as stubs

try:
    API = stubs.install()
except ImportError as exc:  # pragma: no cover - make test installs it
    pytest.skip(f"vllm-omni is not installed ({exc}); run `{stubs.PIP_HINT}`", allow_module_level=True)

init = importlib.import_module("vllm_omni.distributed.omni_connectors.utils.initialization")
REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "vllm_omni" / "qwen3_omni_omnilink.yaml"
EDGES = {("0", "1"), ("1", "2")}


def _with_pipeline_edges(config: dict) -> dict:
    """The deploy dict as the three-stage pipeline sees it: stage 1 reads stage 0's
    output, stage 2 stage 1's (``engine_input_source``), so vLLM-Omni knows every edge
    and fills any edge without a connector with its default."""
    config = copy.deepcopy(config)
    for stage in config["stages" if "stages" in config else "stage_args"]:
        sid = stage["stage_id"]
        if sid > 0:
            stage["engine_input_source"] = [sid - 1]
    return config


def test_every_edge_of_the_example_is_omnilink():
    loaded = init.load_omni_transfer_config(str(EXAMPLE))   # vLLM-Omni parses the YAML itself
    assert loaded is not None
    assert set(loaded.connectors) == EDGES
    assert {edge: spec.name for edge, spec in loaded.connectors.items()} == dict.fromkeys(EDGES, "OmnilinkConnector")
    for spec in loaded.connectors.values():
        assert spec.extra["backend"] == "shm" and spec.extra["options"] == {"arena_bytes": 268435456}
        assert (spec.extra["codec_chunk_frames"], spec.extra["codec_left_context_frames"],
                spec.extra["initial_codec_chunk_frames"]) == (25, 25, 4)


def test_every_edge_is_omnilink_when_the_pipeline_names_its_edges():
    config = _with_pipeline_edges(yaml.safe_load(EXAMPLE.read_text()))
    loaded = init.load_omni_transfer_config(config_dict=config)
    assert {edge: spec.name for edge, spec in loaded.connectors.items()} == dict.fromkeys(EDGES, "OmnilinkConnector")


def test_a_connector_no_stage_names_is_not_used():
    # The README's former shape: defined under connectors (either schema), referenced by no
    # stage. vLLM-Omni falls back to SharedMemoryConnector on every edge.
    example = yaml.safe_load(EXAMPLE.read_text())
    for stage in example["stages"]:
        stage.pop("input_connectors", None)
    legacy = {"runtime": {"connectors": example["connectors"]},
              "stage_args": [dict(s) for s in example["stages"]]}
    for config in (example, legacy):
        loaded = init.load_omni_transfer_config(config_dict=_with_pipeline_edges(config))
        assert {spec.name for spec in loaded.connectors.values()} == {"SharedMemoryConnector"}


def test_the_stages_connectors_carry_a_payload(monkeypatch):
    # What each stage process builds from the config: the receiving stage's spec from
    # get_connectors_config_for_stage, the sending side's from the same edge, both through
    # the real OmniConnectorFactory.
    from omnilink.integrations.vllm_omni import register

    register()
    config = yaml.safe_load(EXAMPLE.read_text())
    channel = f"t{os.getpid()}-deploy"
    config["connectors"]["omnilink_shm"]["extra"]["channel"] = channel
    config["connectors"]["omnilink_shm"]["extra"]["options"] = {"arena_bytes": 4 << 20}
    loaded = init.load_omni_transfer_config(config_dict=config)
    factory, spec_cls = API["OmniConnectorFactory"], API["ConnectorSpec"]
    opened = []
    try:
        for src, dst in sorted(EDGES):
            stage_cfg = init.get_connectors_config_for_stage(loaded, int(dst))[f"from_stage_{src}"]["spec"]
            rx = factory.create_connector(spec_cls(name=stage_cfg["name"], extra={**stage_cfg["extra"], "stage_id": int(dst)}))
            sender_extra = {**loaded.connectors[(src, dst)].extra, "stage_id": int(src), "role": "sender",
                            "from_stage": int(src), "to_stage": int(dst)}
            tx = factory.create_connector(spec_cls(name="OmnilinkConnector", extra=sender_extra))
            opened += [rx, tx]
            assert type(rx).__name__ == type(tx).__name__ == "OmnilinkConnector"
            payload = {"codes.audio": torch.arange(40, dtype=torch.int64) + int(src),
                       "meta": {"finished": torch.tensor(True)}}
            ok, size, metadata = tx.put(src, dst, f"req-1_{src}_0", payload)
            assert ok and size > 0
            got = rx.get(src, dst, f"req-1_{src}_0", metadata)
            assert got is not None
            data, got_size = got
            assert torch.equal(data["codes.audio"], payload["codes.audio"]) and got_size == size
            del data, got
    finally:
        for conn in reversed(opened):
            conn.close()
