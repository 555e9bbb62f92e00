"""A three-stage streaming pipeline, thinker -> talker -> code2wav, over each connector.

Shows: three processes with stand-in models (random weights, sleep-free matmul compute)
streaming vLLM-Omni-shaped payloads: the thinker's prefill chunks and decoded tokens
(``hidden_states.output``, ``embed.prefill``, ``ids.*``) to the talker, whose codec
frames (``codes.audio``, 16 codebooks) go to code2wav in windows cut by
``CodecChunker`` and carried by ``ChunkSender`` / ``ChunkReceiver``. The same pipeline
runs over omnilink ``shm`` and ``zmq``, over vLLM-Omni's own ``SharedMemoryConnector``
(when ``vllm-omni`` is installed) and over pickle into a fresh segment per chunk (the
baseline), and the program asserts that the audio is bit-identical across them and that
every figure (time to first audio, transport per chunk, chunks and bytes per edge) is
there. This is ``omnilink bench pipeline`` in a small configuration; extra arguments are
passed on (``python examples/streaming_pipeline.py --requests 8 --prompt-tokens 1024``);
the default configuration is ``omnilink bench pipeline`` with no options.
Run: ``python examples/streaming_pipeline.py``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from omnilink.cli import main as omnilink_main

SMALL = ["--requests", "2", "--warmup", "1", "--concurrency", "2", "--prompt-tokens", "128",
         "--prefill-chunk", "64", "--hidden", "256", "--ffn", "256", "--decode-tokens", "6", "--rounds", "1"]


def main(argv: list[str] | None = None) -> None:
    extra = sys.argv[1:] if argv is None else argv
    fd, path = tempfile.mkstemp(prefix="streaming-pipeline-", suffix=".json")
    os.close(fd)
    try:
        status = omnilink_main(["bench", "pipeline", *SMALL, *extra, "--json", path])
        assert status == 0, f"omnilink bench pipeline exited with {status}"
        with open(path, encoding="utf-8") as fh:
            report: dict[str, Any] = json.load(fh)
    finally:
        os.unlink(path)

    ran = [r["connector"] for r in report["results"]]
    assert "omnilink-shm" in ran and "pickle-shm" in ran, ran
    for r in report["results"]:
        for figure in ("first_audio_ms_p50", "first_audio_ms_p99", "last_audio_ms_p50",
                       "transport_ms_p50", "transport_ms_p99", "transport_share"):
            assert isinstance(r[figure], float) and r[figure] >= 0, (r["connector"], figure, r[figure])
        assert all(e["chunks"] > 0 and e["bytes"] > 0 and e["unread"] == 0 for e in r["edges"]), r["edges"]
    assert report["identical"] is True, "the audio differs across connectors"
    print(f"audio bit-identical across {', '.join(ran)}")


if __name__ == "__main__":
    main()
