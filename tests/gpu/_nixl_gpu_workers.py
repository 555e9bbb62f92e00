"""Child-process bodies of the nixl GPU tests (importable, spawn-safe)."""

from __future__ import annotations

import traceback


def gpu_payload(i: int, dev: str):
    import torch

    g = torch.Generator(device="cpu").manual_seed(1000 + i)
    hidden = torch.randn(512, 1024, generator=g).to(torch.bfloat16)
    return {"hidden_states.output": hidden.to(dev), "ids.output": (torch.arange(33) + i).to(dev),
            "codes.audio": torch.arange(100, dtype=torch.int64) * i,  # a CPU tensor in the same payload
            "meta": {"finished": torch.tensor(i == 2, device=dev)}, "speaker": "Ethan"}


def sender(channel: str, endpoint: str, dev: str, count: int, q) -> None:
    """Put ``count`` payloads with GPU (on ``dev``) and CPU tensors."""
    try:
        import torch

        import omnilink

        torch.cuda.set_device(torch.device(dev))
        with omnilink.connect("nixl", channel=channel, role="sender", endpoint=endpoint, timeout=60.0) as tx:
            for i in range(count):
                tx.put(f"g{i}", gpu_payload(i, dev))
            q.put(("sent", count))
            import time

            time.sleep(2)
    except BaseException as exc:  # report, never hang the test
        q.put(("error", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
