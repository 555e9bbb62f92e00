"""``omnilink.cuda.Event`` on a real GPU: recycled handles, and why recycling is safe."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

from omnilink.cuda import runtime  # noqa: E402
from omnilink.cuda.runtime import EVENT_POOL_MAX, Event  # noqa: E402

_SLEEP_CYCLES = 400_000_000  # about 0.2 s of one GPU thread spinning


def _drop_pool(index: int) -> None:
    for h in runtime._free_events.pop(index, []):
        runtime.cuda_ops().rt.cudaEventDestroy(h)


def test_a_dead_event_hands_its_handle_to_the_next_event_of_its_device():
    _drop_pool(0)
    first = Event(0)
    handle = int(first.handle)
    del first
    assert int(runtime._free_events[0][-1]) == handle
    again = Event(0)
    assert int(again.handle) == handle
    # The recycled handle works as a new one: pending behind a long kernel, then done.
    s = torch.cuda.Stream(device=0)
    with torch.cuda.stream(s):
        torch.cuda._sleep(_SLEEP_CYCLES)
    again.record(s.cuda_stream)
    assert not again.query()
    again.synchronize()
    assert again.query()


def test_recording_a_recycled_handle_again_leaves_earlier_waits_on_their_work():
    """The safety argument of recycling: a wait enqueued on a handle's recording keeps
    that recording, whatever the handle is recorded on afterwards."""
    _drop_pool(0)
    busy, waiting, idle = (torch.cuda.Stream(device=0) for _ in range(3))
    with torch.cuda.stream(busy):
        torch.cuda._sleep(_SLEEP_CYCLES)
    ev = Event(0).record(busy.cuda_stream)
    runtime.cuda_ops().wait(waiting.cuda_stream, ev)
    marker = Event(0).record(waiting.cuda_stream)  # done only once the wait is over
    handle = int(ev.handle)
    del ev
    reused = Event(0)
    assert int(reused.handle) == handle
    reused.record(idle.cuda_stream)  # nothing queued there: complete at once
    reused.synchronize()
    assert not marker.query(), "the earlier wait was released by the handle's next recording"
    busy.synchronize()
    marker.synchronize()
    assert marker.query()


def test_the_free_list_is_bounded_and_the_rest_are_destroyed():
    _drop_pool(0)
    events = [Event(0) for _ in range(EVENT_POOL_MAX + 10)]
    del events
    assert len(runtime._free_events[0]) == EVENT_POOL_MAX
    _drop_pool(0)
