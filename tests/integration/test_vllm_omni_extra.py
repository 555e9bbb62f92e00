"""``OmnilinkConnector`` checks its whole ``extra`` at construction, for either role.

Created through vLLM-Omni 0.30.0's real ``OmniConnectorFactory`` (loaded without vLLM by
``_vllm_omni_stubs``), with the ``extra`` a receiving stage really gets: vLLM-Omni's
``get_stage_connector_spec`` drops ``from_stage``/``to_stage`` for connectors that are not
transfer engines, so a receiver cannot open its edge at construction and, before issue
28, a bad option surfaced only at each ``get``.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest
import torch

import omnilink
from tests.integration import _vllm_omni_stubs as stubs

try:
    API = stubs.install()
except ImportError as exc:  # pragma: no cover - make test installs it
    pytest.skip(f"vllm-omni is not installed ({exc}); run `{stubs.PIP_HINT}`", allow_module_level=True)

from omnilink.integrations import vllm_omni as integ  # noqa: E402  (after the stubs)
from omnilink.integrations.vllm_omni import config as cfg  # noqa: E402

Factory = API["OmniConnectorFactory"]
Spec = API["ConnectorSpec"]


@pytest.fixture(scope="module", autouse=True)
def registered():
    integ.register()


def _create(role: str, **extra):
    """A connector as vLLM-Omni creates one for a stage: the receiver without its edge."""
    base = {"stage_id": 1 if role == "receiver" else 0, "role": role,
            "channel": f"t{os.getpid()}-extra", "options": {"arena_bytes": 4 << 20}}
    if role == "sender":
        base.update(from_stage=0, to_stage=1)
    base.update(extra)
    return Factory.create_connector(Spec(name="OmnilinkConnector", extra=base))


@pytest.mark.parametrize("role", ["sender", "receiver"])
@pytest.mark.parametrize(
    "extra, named, hint",
    [
        ({"put_timout": 5}, "'put_timout'", "did you mean 'put_timeout'?"),
        ({"zero_cpy": False}, "'zero_cpy'", "did you mean 'zero_copy'?"),
        ({"codec_chunk_frame": 25}, "'codec_chunk_frame'", "did you mean 'codec_chunk_frames'?"),
        ({"options": {"arena_byte": 4 << 20}}, "'arena_byte'", "did you mean 'arena_bytes'?"),
        ({"options": {"arena_bytes": "big"}}, "'arena_bytes'", "must be an int or None, got 'big'"),
        ({"options": {"linger": "5s"}}, "'linger'", "must be a number"),
        ({"options": {"max_bytes": [1]}}, "'max_bytes'", "must be an int or None"),
        ({"backend": "shmm"}, "'shmm'", "did you mean 'shm'?"),
        ({"put_timeout": -1}, "'put_timeout'", ">= 0"),
        ({"pending_ttl": "1h"}, "'pending_ttl'", ">= 0"),
        ({"zero_copy": "yes"}, "'zero_copy'", "must be a bool"),
        ({"max_tracked_keys": 0}, "'max_tracked_keys'", ">= 1"),
        ({"codec_left_context_frames": -1}, "'codec_left_context_frames'", ">= 0"),
        ({"device": "gpu0"}, "'device'", "is not a device"),
        ({"pass_through": "codec_x"}, "'pass_through'", "list of key names"),
    ],
)
def test_a_bad_extra_fails_at_construction_naming_the_key(role, extra, named, hint):
    with pytest.raises(ValueError) as info:  # the factory passes our ConfigurationError on
        conn = _create(role, **extra)
        conn.close()  # only reached when the bad extra was accepted
    msg = str(info.value)
    assert named in msg and hint in msg, msg
    # Directly, without the factory: our own error class.
    with pytest.raises(omnilink.ConfigurationError, match=re.escape(named)):
        integ.OmnilinkConnector({"role": role, **extra}).close()


def test_a_receiver_with_a_bad_option_never_reaches_get():
    # Before: construction passed and every get raised ConfigurationError, which the
    # chunk adapter polls: the request waited instead of the stage failing.
    with pytest.raises(ValueError, match=r"arena_byte.*did you mean 'arena_bytes'"):
        _create("receiver", options={"arena_byte": 1 << 20})


@pytest.mark.parametrize(
    "backend, options, named",
    [
        ("shm", {"arena_bytes": 4096}, "arena_bytes"),
        ("shm", {"linger": -1}, "linger"),
        ("shm", {"device_ipc": "yes"}, "device_ipc"),
        ("shm", {"max_bytes": 1000}, "max_bytes"),
        ("zmq", {"sndhwm": 0}, "sndhwm"),
        ("zmq", {"endpoint": "tcp//127.0.0.1:5555"}, "endpoint"),
        ("zmq", {"curve_secret_key": "0" * 40}, "curve_allowed_clients"),
        ("nccl", {"backend": "gloo", "master_port": 29500, "world_size": 3}, "world_size"),
        ("nccl", {"backend": "gloo", "master_port": 0}, "master_port"),  # rank 1 cannot pick a port
        ("nccl", {"backend": "gloo"}, "master_port"),
        ("memory", {"capacity_bytes": 0}, "capacity_bytes"),
        ("memory", {"timeout": -1}, "timeout"),
    ],
)
def test_a_receiver_with_an_out_of_range_option_fails_at_construction(backend, options, named):
    # Before: names and types were checked at construction, ranges only by the backend's
    # constructor, which a receiver (no edge at construction) ran at its first get.
    with pytest.raises(ValueError) as info:
        _create("receiver", backend=backend, options=options).close()
    msg = str(info.value)
    assert "extra['options']" in msg and named in msg, msg


def test_the_options_are_checked_for_each_side_the_stage_opens():
    # A receiver binds tcp://HOST:* (the OS picks the port); a sender cannot connect
    # there. A "dual" stage opens both sides lazily, so both are checked at construction.
    options = {"endpoint": "tcp://127.0.0.1:*"}
    _create("receiver", backend="zmq", options=options).close()
    with pytest.raises(omnilink.ConfigurationError, match=r"extra\['options'\]: zmq: a sender cannot connect"):
        integ.OmnilinkConnector({"role": "dual", "backend": "zmq", "options": options}).close()


def test_a_receiver_opens_nothing_and_works_with_a_good_extra():
    prefix = os.environ.get("OMNILINK_SHM_PREFIX", "omnilink")  # this run's (tests/conftest.py)

    def ours() -> set[str]:  # other runs may share /dev/shm
        return {n for n in os.listdir("/dev/shm") if n.startswith((prefix, "sem." + prefix))}

    before = ours()
    rx = _create("receiver", codec_chunk_frames=25, codec_chunk_ramp=[4, 8], pass_through=["my_custom_key"],
                 my_custom_key={"x": 1}, put_timeout=None, reclaim_after=60)
    try:
        assert ours() == before  # checked without opening anything
        assert rx.role == "receiver" and rx.config["my_custom_key"] == {"x": 1}
        assert rx.get("0", "1", "req_0_0") is None  # not there yet: polled, no error
    finally:
        rx.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_what_cannot_work_in_this_process_fails_at_construction():
    with pytest.raises(ValueError, match=r"'device'\] is 'cuda:0' but this process sees 0 CUDA device"):
        _create("receiver", device="cuda:0")
    with pytest.raises(ValueError, match=r"'cuda_ipc' cannot be used here"):
        _create("receiver", backend="cuda_ipc", options={})


def test_every_extra_key_vllm_omni_reads_is_known():
    # VLLM_OMNI_KEYS is what 0.30.0's stage processors read from a connector's extra;
    # a key read there and missing from the list would be refused as unknown.
    root = pathlib.Path(stubs.vllm_omni_root())
    files = list((root / "model_executor" / "stage_input_processors").glob("*.py"))
    files.append(root / "model_executor" / "models" / "audex" / "audex_code2wav.py")
    read: set[str] = set()
    for path in files:
        text = path.read_text()
        read |= set(re.findall(r"\b(?:cfg|extra_cfg)\.get\(\"([a-z_0-9]+)\"", text))
        read |= set(re.findall(r"_cfg_(?:int|float|bool)\(cfg, \"([a-z_0-9]+)\"", text))
    assert "codec_chunk_frames" in read and "codec_chunk_ramp" in read  # the scan found them
    known = set(cfg.ADAPTER_KEYS) | set(cfg.VLLM_OMNI_KEYS) | set(cfg.INJECTED_KEYS)
    assert read - known == set(), sorted(read - known)
