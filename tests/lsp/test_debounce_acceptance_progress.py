"""The adaptive debounce's rule on a made-up clock, the local acceptance statistics, and the
engine start-up progress as a client sees it (create first, then begin/report/end)."""

import random
from concurrent.futures import Future

import pytest
from lsprotocol import types as T

from wd_lsp import debounce as D
from wd_lsp.acceptance import AcceptanceStats
from wd_lsp.progress import EngineProgress

# -- the debounce ----------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def typed(debounce, clock, uri, intervals_ms):
    for ms in intervals_ms:
        clock.now += ms / 1000
        debounce.edited(uri)


def test_the_fixed_wait_until_enough_typing_is_seen():
    clock = Clock()
    d = D.Debounce(clock)
    assert d.remaining_s("a", "adaptive", 60) == pytest.approx(0.060)
    typed(d, clock, "a", [0] + [120] * (D.MIN_INTERVALS - 1))  # one interval short
    assert d.wait_ms("a", 60) == 60
    assert d.remaining_s("a", "fixed", 60) == pytest.approx(0.060)


def test_the_wait_follows_the_typing_speed_and_the_engine_latency():
    rng = random.Random(5)
    clock = Clock()
    d = D.Debounce(clock)
    intervals = [rng.uniform(100, 140) for _ in range(D.INTERVALS_KEPT)]
    typed(d, clock, "a", [0, *intervals])
    typing = sorted(intervals)[len(intervals) // 2 - 1 : len(intervals) // 2 + 1]
    assert d.typing_ms("a") == pytest.approx(sum(typing) / 2)
    wait = d.wait_ms("a", 60)
    assert wait == pytest.approx(D.TYPING_FACTOR * d.typing_ms("a"))
    # Measured from the last edit: part of it has passed already.
    clock.now += 0.05
    assert d.remaining_s("a", "adaptive", 60) == pytest.approx((wait - 50) / 1000)
    # A fast engine lowers the wait to its latency; a slow one leaves the typing's.
    for ms in (40.0, 35.0, 45.0):
        d.engine_took(ms)
    assert d.wait_ms("a", 60) == pytest.approx(40.0)
    slow = D.Debounce(clock)
    typed(slow, clock, "a", [0, *intervals])
    slow.engine_took(5000.0)
    assert slow.wait_ms("a", 60) == pytest.approx(wait)
    # Slow typing: never more than the cap.
    sluggish = D.Debounce(clock)
    typed(sluggish, clock, "b", [0] + [900] * D.MIN_INTERVALS)
    assert sluggish.wait_ms("b", 60) == D.MAX_WAIT_MS


def test_pauses_are_not_typing_and_an_invoked_request_never_waits():
    clock = Clock()
    d = D.Debounce(clock)
    typed(d, clock, "a", [0, 3000, 5000, 2000, 1500, 80])
    assert d.typing_ms("a") is None  # one interval under the pause: not enough
    assert d.remaining_s("a", "adaptive", 60, invoked=True) == 0
    assert d.remaining_s("a", "fixed", 60, invoked=True) == 0 and d.last_wait_ms == 0
    typed(d, clock, "a", [90, 100, 110])
    assert d.typing_ms("a") == pytest.approx(95)
    d.forget("a")
    assert d.typing_ms("a") is None


def test_the_typing_of_only_so_many_documents_is_remembered():
    clock = Clock()
    d = D.Debounce(clock)
    for n in range(D.DOCUMENTS_KEPT + 10):
        typed(d, clock, f"doc{n}", [0, 100, 100, 100, 100])
    assert len(d._last_edit) == D.DOCUMENTS_KEPT and len(d._intervals) <= D.DOCUMENTS_KEPT
    assert d.typing_ms("doc0") is None and d.typing_ms(f"doc{D.DOCUMENTS_KEPT + 9}") is not None


# -- acceptance statistics -------------------------------------------------------------------------


def test_acceptance_is_counted_per_language_once_per_item_and_kind():
    stats = AcceptanceStats()
    py = [stats.issue("python") for _ in range(3)]
    rs = stats.issue("rust")
    assert len(set(py + [rs])) == 4
    assert stats.shown(py[0]) and not stats.shown(py[0])  # a redraw adds nothing
    assert stats.shown(py[1]) and stats.shown(rs)
    assert stats.accepted(py[0], "word") and not stats.accepted(py[0], "word")
    assert stats.accepted(py[0], "line") and stats.accepted(py[0])  # then the rest of it
    assert not stats.accepted(py[0], "full")
    assert stats.accepted(rs, "full")
    for bad_id in ("nope", None, 7, {"id": py[2]}):
        assert not stats.shown(bad_id) and not stats.accepted(bad_id)
    assert not stats.accepted(py[2], "sentence")
    assert stats.summary() == {
        "python": {"shown": 2, "accepted": 1, "partialWord": 1, "partialLine": 1},
        "rust": {"shown": 1, "accepted": 1, "partialWord": 0, "partialLine": 0},
    }


def test_only_so_many_ids_are_remembered():
    stats = AcceptanceStats(max_items=5)
    ids = [stats.issue("go") for _ in range(8)]
    assert not stats.accepted(ids[0])  # forgotten
    assert all(stats.accepted(i) for i in ids[3:])
    assert len(stats._items) == 5
    # Another server process's IDs never match.
    assert not AcceptanceStats().accepted(ids[-1])


# -- start-up progress -----------------------------------------------------------------------------


class Client:
    """Records what a progress sends; answers each create request when told."""

    def __init__(self):
        self.creates: list[tuple[str, Future]] = []
        self.sent: list[tuple[str, str]] = []  # (token, kind)

    def send_request(self, method, params):
        assert method == T.WINDOW_WORK_DONE_PROGRESS_CREATE
        future = Future()
        self.creates.append((params.token, future))
        return future

    def notify(self, method, params):
        assert method == T.PROGRESS
        self.sent.append((params.token, params.value.kind, getattr(params.value, "message", None)))


def test_progress_waits_for_the_create_answer_then_begins_reports_and_ends():
    client = Client()
    progress = EngineProgress(client.send_request, client.notify)
    progress.report("not supported: nothing")
    assert not client.creates
    progress.supported = True
    progress.report("starting the engine")
    progress.report("loading the model (1 s)")
    assert len(client.creates) == 1 and client.sent == []  # nothing before the answer
    token, future = client.creates[0]
    future.set_result(None)
    progress.report("loading the model (2 s)")
    progress.end("engine ready")
    assert client.sent == [
        (token, "begin", "starting the engine"),
        (token, "report", "loading the model (1 s)"),
        (token, "report", "loading the model (2 s)"),
        (token, "end", "engine ready"),
    ]
    progress.end("again")  # nothing under way: nothing sent
    # The next start is a new progress, with a new token; ended before the client answered, it is
    # sent whole once it has.
    progress.report("starting the engine")
    progress.end("engine unavailable")
    (token2, future2) = client.creates[1]
    assert token2 != token
    future2.set_result(None)
    assert [kind for t, kind, _ in client.sent if t == token2] == ["begin", "end"]


def test_a_refused_progress_sends_nothing_for_that_start():
    client = Client()
    progress = EngineProgress(client.send_request, client.notify)
    progress.supported = True
    progress.report("starting the engine")
    _, future = client.creates[0]
    future.set_exception(RuntimeError("no"))
    progress.report("loading the model (1 s)")
    progress.end("engine ready")
    assert client.sent == [] and len(client.creates) == 1
