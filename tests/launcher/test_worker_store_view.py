"""An agent's view of a worker store it does not host (launcher/worker_store.py), against
real TCPStores: where the store can move (a deadline on its connections), a store that
stopped answering is tried again now and then, so a store that comes back where it was
is read again without a move; without a deadline the view waits for the move."""

import time

from chameleon_runtime.protocol.messages import Keys, WorkerStatus
from launcher.store import bind_listener, serve_store
from launcher.worker_store import WorkerStoreView


def _status(store, rank: int, beat: int) -> None:
    body = WorkerStatus(
        pid=100 + rank, beat=beat, phase="train", generation=0, step=beat, progress=beat
    )
    store.set(Keys(0).status(rank), body.model_dump_json())


def _serve(port: int):
    store = serve_store(bind_listener("127.0.0.1", port), timeout_s=10)
    _status(store, 0, 1)
    return store


def test_a_store_that_stopped_answering_is_tried_again_where_it_can_move():
    first = _serve(0)
    port = first.port
    view = WorkerStoreView(0, "127.0.0.1", port, hosted=lambda: None, link_s=0.5)
    assert view.statuses([0])[0].beat == 1
    del first  # its host is gone
    assert view.statuses([0]) == {} and not view.reachable
    again = _serve(port)  # (back where it was: no move)
    assert view.statuses([0]) == {}  # not tried again at once: the loop must not block
    time.sleep(1.1)  # two deadlines
    assert view.statuses([0])[0].beat == 1 and view.reachable
    del again


def test_without_a_deadline_the_view_waits_for_the_move():
    first = _serve(0)
    port = first.port
    view = WorkerStoreView(0, "127.0.0.1", port, hosted=lambda: None)
    assert view.statuses([0])[0].beat == 1
    del first
    assert view.statuses([0]) == {}
    again = _serve(port)
    time.sleep(1.1)
    assert view.statuses([0]) == {} and not view.reachable
    view.move("127.0.0.1", port)
    assert view.statuses([0])[0].beat == 1
    del again
