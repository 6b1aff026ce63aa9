"""The host-load estimate (engine.model.host_load) on fake /proc/stat contents and clocks, and the
rule (engine.model.cpu_threads) that runs a long CPU forward on one thread while other processes
keep a core busy."""

import pytest
import torch

from engine.loading.random_model import TINY, random_model
from engine.model import cpu_threads, host_load
from engine.model.host_load import HostLoad, busy_ticks

TICKS = 100  # per second


def _stat(*cpus):
    """/proc/stat text for per-CPU (busy, idle) ticks; busy split over user and system, some
    iowait counted as idle time."""

    def line(name, busy, idle):
        return f"{name} {busy - busy // 4} 0 {busy // 4} {idle - 3} 3 0 0 0 0 0"

    lines = [line("cpu", sum(b for b, _ in cpus), sum(i for _, i in cpus))]
    lines += [line(f"cpu{n}", b, i) for n, (b, i) in enumerate(cpus)]
    return "\n".join(lines + ["intr 1234 5 6", "ctxt 99", "btime 1700000000"]) + "\n"


class FakeHost:
    """Two CPUs whose busy and idle ticks, this process's CPU time and the wall clock the test
    advances."""

    def __init__(self, cpus=2):
        self.ticks = [[0, 0] for _ in range(cpus)]
        self.own_s = 0.0
        self.now = 1000.0
        self.readable = True

    def run(self, seconds, others_busy, own_busy=0.0):
        """seconds of wall time with others_busy cores kept busy by others and own_busy by us."""
        busy = (others_busy + own_busy) * seconds * TICKS
        total = len(self.ticks) * seconds * TICKS
        for cpu in self.ticks:
            cpu[0] += round(busy / len(self.ticks))
            cpu[1] += round((total - busy) / len(self.ticks))
        self.own_s += own_busy * seconds
        self.now += seconds

    def read(self):
        if not self.readable:
            raise OSError("no /proc/stat here")
        return _stat(*map(tuple, self.ticks))

    def load(self, cpus=(0, 1)):
        return HostLoad(self.read, lambda: self.own_s, lambda: self.now, list(cpus), TICKS)


def test_busy_ticks_reads_the_aggregate_or_the_allowed_cpus():
    text = _stat((50, 950), (400, 600), (0, 1000))
    assert busy_ticks(text, [0, 1, 2]) == (450, 3)
    assert busy_ticks(text, None) == (450, 3)
    assert busy_ticks(text, [1, 2]) == (400, 2)
    assert busy_ticks(text, [1, 7]) is None  # a CPU the file does not list
    assert busy_ticks("intr 1 2\n", None) is None


def test_an_idle_host_reads_zero():
    host = FakeHost()
    load = host.load()
    host.run(1.0, others_busy=0.0)
    assert load.others_busy_cores() == pytest.approx(0.0)
    assert load.cores == 2


def test_a_neighbour_on_one_core_reads_one():
    host = FakeHost()
    load = host.load()
    host.run(0.5, others_busy=1.0)
    assert load.others_busy_cores() == pytest.approx(1.0)


def test_this_process_work_is_not_counted_as_others():
    host = FakeHost()
    load = host.load()
    host.run(0.5, others_busy=0.0, own_busy=2.0)  # our two threads on both cores
    assert load.others_busy_cores() == pytest.approx(0.0)
    host.run(0.5, others_busy=1.0, own_busy=1.0)
    assert load.others_busy_cores() == pytest.approx(1.0)


def test_a_look_soon_after_the_last_reuses_its_estimate():
    host = FakeHost()
    load = host.load()
    host.run(0.2, others_busy=1.0)
    assert load.others_busy_cores() == pytest.approx(1.0)
    host.run(0.01, others_busy=0.0)  # too short to say anything: the last estimate stands
    assert load.others_busy_cores() == pytest.approx(1.0)
    host.run(
        0.05, others_busy=0.0
    )  # now 60 ms since the last estimate, over which others averaged 0
    assert load.others_busy_cores() == pytest.approx(0.0)


def test_an_unreadable_proc_stat_is_unknown():
    host = FakeHost()
    host.readable = False
    load = host.load()
    host.run(1.0, others_busy=1.0)
    assert load.others_busy_cores() is None
    host.readable = True
    load = host.load()
    host.readable = False
    host.run(1.0, others_busy=1.0)
    assert load.others_busy_cores() is None


def test_only_the_allowed_cpus_count():
    host = FakeHost(cpus=4)
    load = host.load(cpus=(0, 1))
    host.run(1.0, others_busy=2.0)  # spread over 4 CPUs: half a core each
    assert load.cores == 2 and load.others_busy_cores() == pytest.approx(1.0)


def test_this_host_proc_stat_parses_where_it_exists():
    try:
        text = host_load._read_proc_stat()
    except OSError:
        pytest.skip("no /proc/stat here")
    busy, cpus = busy_ticks(text, None)
    assert busy > 0 and cpus >= 1


# -- the rule in engine.model.cpu_threads ---------------------------------------------------------

LONG = cpu_threads.CPU_ONE_THREAD_MAX_TOKENS + 8


def _threads_in_forward(monkeypatch, load, n_tokens):
    """torch's intra-op threads inside a forward of n_tokens under the given host_load answer,
    and the logits."""
    monkeypatch.setattr(cpu_threads, "THREADS_ADJUSTABLE", True)
    monkeypatch.setattr(host_load, "others_busy_cores", lambda: load)
    model = random_model(dict(TINY, vocab_size=512), dtype=torch.float32, seed=21)
    seen = []
    real = model._forward

    def spy(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(model, "_forward", spy)
    tokens = torch.arange(n_tokens)[None] % 512
    logits = model.forward(tokens, torch.arange(n_tokens)[None], model.new_cache(1, n_tokens))
    return seen[0], logits


@pytest.fixture
def two_threads():
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("intra-op threads change mid-process only on OpenMP builds of torch")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_long_forward_runs_on_one_thread_while_a_neighbour_holds_a_core(monkeypatch, two_threads):
    threads, busy_logits = _threads_in_forward(monkeypatch, (1.0, 2), LONG)
    assert threads == 1 and torch.get_num_threads() == 2
    threads, idle_logits = _threads_in_forward(monkeypatch, (0.1, 2), LONG)
    assert threads == 2
    assert ((busy_logits - idle_logits).abs().max() / idle_logits.abs().max()).item() < 1e-5


def test_a_long_forward_keeps_all_threads_where_the_load_is_unknown(monkeypatch, two_threads):
    assert _threads_in_forward(monkeypatch, None, LONG)[0] == 2


def test_more_cores_than_threads_leave_room_for_a_neighbour(monkeypatch, two_threads):
    assert _threads_in_forward(monkeypatch, (1.0, 4), LONG)[0] == 2
    assert _threads_in_forward(monkeypatch, (2.8, 4), LONG)[0] == 1


def test_a_many_core_host_gives_up_only_the_threads_a_neighbour_takes(monkeypatch):
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("intra-op threads change mid-process only on OpenMP builds of torch")
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert _threads_in_forward(monkeypatch, (1.0, 4), LONG)[0] == 3
        assert _threads_in_forward(monkeypatch, (0.4, 4), LONG)[0] == 4
        assert _threads_in_forward(monkeypatch, (3.9, 4), LONG)[0] == 1
    finally:
        torch.set_num_threads(before)


def test_short_forwards_stay_on_one_thread_on_an_idle_host(monkeypatch, two_threads):
    assert _threads_in_forward(monkeypatch, (0.0, 2), 8)[0] == 1
