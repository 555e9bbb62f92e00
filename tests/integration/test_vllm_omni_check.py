"""``omnilink check``: deployment files edge by edge, checked against vLLM-Omni's loader.

The checker imports neither vLLM nor vLLM-Omni. Here its edge list is compared with
what vLLM-Omni 0.30.0's own ``load_omni_transfer_config`` (loaded without vLLM by
``_vllm_omni_stubs``) makes of the same dict, on the repository's example and on every
deploy file the vllm-omni wheel ships; broken variants of the example must each be a
problem naming the key.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import pathlib

import pytest
import torch
import yaml

from omnilink.cli import main
from omnilink.integrations.vllm_omni import check as chk
from tests.integration import _vllm_omni_stubs as stubs

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "vllm_omni" / "qwen3_omni_omnilink.yaml"
MiB = 1 << 20


def _loader():
    try:
        stubs.install()
    except ImportError as exc:  # pragma: no cover - make test installs it
        pytest.skip(f"vllm-omni is not installed ({exc}); run `{stubs.PIP_HINT}`")
    return importlib.import_module("vllm_omni.distributed.omni_connectors.utils.initialization")


def _deploy_files() -> list[pathlib.Path]:
    root = stubs.vllm_omni_root()
    return sorted(pathlib.Path(root, "deploy").glob("*.yaml")) if root else []


def _edges(report: chk.FileReport) -> dict[tuple[str, str], str]:
    return {(e.from_stage, e.to_stage): e.connector for e in report.edges}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["check", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# -------------------------------------------------------------- agrees with vLLM-Omni
def test_the_example_checks_clean(capsys):
    rc, out, err = _run(capsys, str(EXAMPLE))
    assert rc == 0, out + err
    assert "edge 0 -> 1: OmnilinkConnector 'omnilink_shm', backend shm" in out
    assert "edge 1 -> 2: OmnilinkConnector 'omnilink_shm', backend shm" in out
    assert out.count("ok: extra and options validate") == 2 and out.rstrip().endswith("ok")


def _variants_of_the_example() -> list[dict]:
    base = yaml.safe_load(EXAMPLE.read_text())
    piped = copy.deepcopy(base)
    for stage in piped["stages"]:
        if stage["stage_id"] > 0:
            stage["engine_input_source"] = [stage["stage_id"] - 1]
    unnamed = copy.deepcopy(piped)  # the README's former shape: defined, never referenced
    for stage in unnamed["stages"]:
        stage.pop("input_connectors", None)
    legacy = {"runtime": {"connectors": base["connectors"], "edges": [{"from": 0, "to": 1}]},
              "stage_args": [{"stage_id": 0, "output_connectors": {"to_stage_1": "omnilink_shm"}},
                             {"stage_id": 1}, {"stage_id": 2, "engine_input_source": [1]}]}
    inline = copy.deepcopy(base)
    inline["stages"][2]["input_connectors"]["from_stage_1"] = {"name": "OmnilinkConnector",
                                                               "extra": {"backend": "zmq"}}
    return [base, piped, unnamed, legacy, inline]


def test_edges_equal_vllm_omnis_loader_on_the_example_and_its_variants():
    init = _loader()
    for config in _variants_of_the_example():
        theirs = init.load_omni_transfer_config(config_dict=copy.deepcopy(config))
        mine = chk.check_config(copy.deepcopy(config), host=False)
        assert _edges(mine) == {k: v.name for k, v in theirs.connectors.items()}
    assert set(_edges(chk.check_config(_variants_of_the_example()[2], host=False)).values()) == {
        "SharedMemoryConnector"}


def test_edges_equal_vllm_omnis_loader_on_every_shipped_deploy_file():
    init = _loader()
    files = _deploy_files()
    assert len(files) >= 50, "the vllm-omni wheel ships its deploy/*.yaml"
    with_edges = 0
    for path in files:
        config = chk.load_deploy_file(path)  # base_config resolved as resolve_deploy_yaml does
        mine = chk.check_config(copy.deepcopy(config), path=str(path), host=False)
        theirs = init.load_omni_transfer_config(config_dict=copy.deepcopy(config))
        assert _edges(mine) == ({} if theirs is None else {k: v.name for k, v in theirs.connectors.items()}), path
        assert mine.problem_count == 0, chk.format_report(mine)
        with_edges += bool(mine.edges)
    assert with_edges >= 50


def test_what_vllm_omnis_loader_refuses_is_a_problem():
    init = _loader()
    config = yaml.safe_load(EXAMPLE.read_text())
    config["stages"][1]["input_connectors"]["from_stage_0"] = "omnilink_shmm"
    with pytest.raises(ValueError, match="Undefined connector reference"):
        init.load_omni_transfer_config(config_dict=copy.deepcopy(config))
    report = chk.check_config(config, host=False)
    assert any("undefined connector reference 'omnilink_shmm' (did you mean 'omnilink_shm'?)" in p
               for p in report.problems), report.problems


# --------------------------------------------------------------------- broken files
def _write(tmp_path, mutate) -> pathlib.Path:
    config = yaml.safe_load(EXAMPLE.read_text())
    mutate(config)
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _extra(config) -> dict:
    return config["connectors"]["omnilink_shm"]["extra"]


@pytest.mark.parametrize(
    "mutate, says",
    [
        (lambda c: _extra(c).update(put_timout=5), "'put_timout' (did you mean 'put_timeout'?)"),
        (lambda c: _extra(c)["options"].update(arena_byte=1), "'arena_byte' (did you mean 'arena_bytes'?)"),
        (lambda c: _extra(c)["options"].update(arena_bytes="big"), "'arena_bytes' of backend 'shm' must be an int"),
        (lambda c: _extra(c).update(backend="shmm"), "unknown backend 'shmm' (did you mean 'shm'?)"),
        # Ranges, from the backend's own check_options (the constructor's checks).
        (lambda c: _extra(c)["options"].update(linger=-1), "linger must be a number of seconds >= 0, got -1"),
        (lambda c: _extra(c)["options"].update(arena_bytes=4096), "arena_bytes must be an int >= 1048576"),
        (lambda c: _extra(c).update(backend="zmq", options={"endpoint": "tcp://127.0.0.1:*"}),
         "zmq: a sender cannot connect to 'tcp://127.0.0.1:*'"),
        (lambda c: _extra(c).update(codec_chunk_frames=0), "extra['codec_chunk_frames'] must be an int >= 1"),
        (lambda c: c["connectors"]["omnilink_shm"].update(name="OmniLinkConnector"),
         "unknown connector 'OmniLinkConnector' (did you mean 'OmnilinkConnector'?)"),
        (lambda c: c["connectors"]["omnilink_shm"].update(extras={}), "key 'extras' is ignored by vLLM-Omni"),
        (lambda c: c["stages"][1].update(input_connectors={"from_stage0": "omnilink_shm"}),
         "the key must be from_stage_<id>"),
        (lambda c: c["stages"][1].update(input_connectors={"from_stage_7": "omnilink_shm"}),
         "stage 7 is not one of the file's stages"),
        (lambda c: [s.pop("input_connectors", None) for s in c["stages"]],
         "is defined but no stage names it"),
    ],
)
def test_a_broken_file_is_a_problem_naming_the_key(tmp_path, capsys, mutate, says):
    rc, out, err = _run(capsys, "--file-only", str(_write(tmp_path, mutate)))
    assert rc == 1, out + err
    assert says in out, out


def test_an_arena_that_does_not_fit_here_is_a_problem_here(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, lambda c: None)  # two 256 MiB arenas
    real = os.statvfs("/dev/shm")

    class Small:  # /dev/shm of a default container: 64 MiB
        f_frsize, f_bavail = 4096, (64 * MiB) // 4096

    monkeypatch.setattr(chk.os, "statvfs", lambda p: Small if p == "/dev/shm" else real)
    rc, out, _ = _run(capsys, str(path))
    assert rc == 1 and "problem here: options.arena_bytes is 256 MiB but /dev/shm has 64 MiB free" in out, out
    assert "--shm-size" in out
    rc, out, _ = _run(capsys, "--file-only", str(path))  # the file itself is fine
    assert rc == 0, out
    # Without arena_bytes the arena is sized to fit: no problem.
    path = _write(tmp_path, lambda c: _extra(c).pop("options"))
    rc, out, _ = _run(capsys, str(path))
    assert rc == 0 and "the sender's arena starts at 16 MiB" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_backend_that_cannot_run_here_is_a_problem_here(tmp_path, capsys):
    path = _write(tmp_path, lambda c: _extra(c).update(backend="cuda_ipc", options={}, device="cuda:0"))
    rc, out, _ = _run(capsys, str(path))
    assert rc == 1 and "problem here: backend 'cuda_ipc' cannot run here" in out, out
    rc, out, _ = _run(capsys, "--file-only", str(path))
    assert rc == 0, out


def test_json_output(capsys):
    rc, out, _ = _run(capsys, "--json", str(EXAMPLE))
    rec = json.loads(out)
    assert rc == 0 and rec["problems"] == 0
    edges = rec["files"][0]["edges"]
    assert [(e["from_stage"], e["to_stage"], e["connector"], e["backend"]) for e in edges] == [
        ("0", "1", "OmnilinkConnector", "shm"), ("1", "2", "OmnilinkConnector", "shm")]


def test_base_config_is_resolved(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text(EXAMPLE.read_text())
    (tmp_path / "overlay.yaml").write_text(
        "base_config: base.yaml\nconnectors:\n  omnilink_shm:\n    extra: {put_timout: 5}\n")
    rc, out, _ = _run(capsys, "--file-only", str(tmp_path / "overlay.yaml"))
    assert rc == 1 and "'put_timout' (did you mean 'put_timeout'?)" in out and "edge 1 -> 2" in out, out


@pytest.mark.parametrize(
    "name, text, says",
    [
        ("missing.yaml", None, "cannot read"),
        ("bad.yaml", "stages: [\n", "invalid YAML"),
        ("list.yaml", "- 1\n", "a mapping at the top"),
        ("deploy.toml", "x = 1\n", "unsupported file type"),
        ("loop.yaml", "base_config: loop.yaml\n", "base_config chain"),
    ],
)
def test_an_unreadable_file_is_exit_status_2(tmp_path, capsys, name, text, says):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    rc, out, err = _run(capsys, str(EXAMPLE), str(path))
    assert rc == 2 and says in err, err


def test_the_deploy_file_of_the_deploying_guide_checks_clean(tmp_path, capsys):
    import re

    text = (REPO / "docs" / "deploying.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "OmnilinkConnector" in b]
    assert len(blocks) == 1
    path = tmp_path / "my_deploy.yaml"
    path.write_text(blocks[0])
    rc, out, _ = _run(capsys, str(path))
    assert rc == 0, out
    assert [(e.from_stage, e.to_stage, e.connector) for e in chk.check_file(path).edges] == [
        ("0", "1", "OmnilinkConnector"), ("1", "2", "OmnilinkConnector")]
    # The output the guide shows has the same lines, up to this machine's /dev/shm.
    shown = text.split("```text\n", 1)[1].split("```", 1)[0]
    strip = lambda s: [re.sub(r"\(/dev/shm: \d+ MiB free\)|starts at \d+ MiB", "", ln).strip()
                       for ln in s.splitlines()[1:]]
    assert strip(out) == strip(shown), out


def test_a_json_deploy_file_is_read_like_yaml(tmp_path, capsys):
    path = tmp_path / "deploy.json"
    path.write_text(json.dumps(yaml.safe_load(EXAMPLE.read_text())))
    rc, out, _ = _run(capsys, "--file-only", str(path))
    assert rc == 0 and out.count("OmnilinkConnector 'omnilink_shm'") == 2, out


def test_vllm_plugins_without_omnilink_is_a_problem_here(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    rc, out, _ = _run(capsys, str(EXAMPLE))
    assert rc == 1 and "problem here: vLLM-Omni would not load omnilink's plugin here" in out, out
    assert "VLLM_PLUGINS=lora_filesystem_resolver,omnilink" in out
    rc, out, _ = _run(capsys, "--file-only", str(EXAMPLE))
    assert rc == 0, out
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver,omnilink")
    rc, out, _ = _run(capsys, str(EXAMPLE))
    assert rc == 0, out


def test_nixl_named_on_one_edge(tmp_path, capsys):
    """An edge may name the nixl backend while the other keeps shm; its options are
    checked against the nixl backend's own schema."""
    from omnilink.connectors import backend_unavailable

    def mutate(c):
        c["stages"][2]["input_connectors"]["from_stage_1"] = {
            "name": "OmnilinkConnector",
            "extra": {"backend": "nixl", "options": {"endpoint": "tcp://127.0.0.1:29555", "pool_bytes": 64 << 20}}}

    rc, out, _ = _run(capsys, str(_write(tmp_path, mutate)))
    assert "edge 0 -> 1: OmnilinkConnector 'omnilink_shm', backend shm" in out, out
    assert "edge 1 -> 2: OmnilinkConnector" in out and "backend nixl" in out, out
    if backend_unavailable("nixl") is None:
        assert rc == 0, out
    bad = _write(tmp_path, lambda c: (mutate(c), c["stages"][2]["input_connectors"]["from_stage_1"]["extra"]
                                      ["options"].update(pool_byte=1)))
    rc, out, _ = _run(capsys, "--file-only", str(bad))
    assert rc == 1 and "'pool_byte' (did you mean 'pool_bytes'?)" in out, out


def _nccl_edge(c):
    c["stages"][2]["input_connectors"]["from_stage_1"] = {
        "name": "OmnilinkConnector",
        "extra": {"backend": "nccl", "options": {"master_port": 29600}}}


def _nccl_edge_on_gpus(tmp_path, monkeypatch):
    """A file whose stage 2 reads an nccl edge, on a machine faked to have a GPU and
    NCCL (so the edge would run on NCCL here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    return _write(tmp_path, _nccl_edge)


def test_nccl_on_gpus_without_cuda_python_is_a_problem_here(tmp_path, capsys, monkeypatch):
    """An nccl edge that would run on NCCL here (a GPU and NCCL present) needs
    cuda-python for its per-message CUDA calls: without it, a problem here naming the
    extra; with it, or over gloo, none."""
    import omnilink.cuda as ocuda

    path = _nccl_edge_on_gpus(tmp_path, monkeypatch)
    monkeypatch.setattr(ocuda, "have_cuda_ops", lambda: False)
    rc, out, _ = _run(capsys, str(path))
    assert rc == 1 and "needs cuda-python" in out and "pyomnilink[cuda]" in out, out
    monkeypatch.setattr(ocuda, "have_cuda_ops", lambda: True)
    rc, out, _ = _run(capsys, str(path))
    assert "needs cuda-python" not in out, out
    monkeypatch.setattr(ocuda, "have_cuda_ops", lambda: False)
    gloo = _write(tmp_path, lambda c: (_nccl_edge(c), c["stages"][2]["input_connectors"]["from_stage_1"]["extra"]
                                       ["options"].update(backend="gloo")))
    rc, out, _ = _run(capsys, str(gloo))
    assert "needs cuda-python" not in out, out


def test_nccl_on_gpus_without_nccls_library_is_a_problem_here(tmp_path, capsys, monkeypatch):
    """The nccl backend on GPUs calls NCCL's library itself: where it does not load, a
    problem here with the loader's reason; where it loads, none."""
    import omnilink.cuda as ocuda
    from omnilink._errors import CudaError

    path = _nccl_edge_on_gpus(tmp_path, monkeypatch)
    monkeypatch.setattr(ocuda, "have_cuda_ops", lambda: True)

    def missing():
        raise CudaError(f"no NCCL library could be loaded (tried libnccl.so.2): set {ocuda.NCCL_LIBRARY_ENV}")

    monkeypatch.setattr(ocuda, "nccl_library", missing)
    rc, out, _ = _run(capsys, str(path))
    assert rc == 1 and "calls NCCL's library" in out and ocuda.NCCL_LIBRARY_ENV in out, out
    monkeypatch.setattr(ocuda, "nccl_library", lambda: object())
    rc, out, _ = _run(capsys, str(path))
    assert "calls NCCL's library" not in out, out
