"""How many of this process's cores other processes kept busy lately (Linux /proc/stat).

engine.model.cpu_threads asks before a long CPU forward whether its intra-op threads would each
get a core: on a 2-core host with a neighbour busy on one core, two OpenMP threads make every split
op wait for a thread that cannot run (BENCHMARKS.md). No background thread: each look compares the
CPUs' busy time in /proc/stat and this process's own CPU time with those of the previous look.
Where /proc/stat cannot be read (macOS, Windows, some containers) the answer is None: unknown.
"""

from __future__ import annotations

import os
import time

# A look this soon after the last one reuses its estimate: /proc/stat counts in ticks of 10 ms
# per CPU, so over a shorter interval the difference is mostly rounding.
MIN_INTERVAL_S = 0.05


def _read_proc_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def _own_cpus() -> list[int] | None:
    """The CPUs this process may run on; None where the OS does not say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def busy_ticks(stat: str, cpus: list[int] | None) -> tuple[int, int] | None:
    """(busy ticks, CPUs counted) of /proc/stat's text: summed over the lines of `cpus`, or the
    aggregate line where cpus is None or covers every CPU listed. None where the text has no such
    line. Busy is all time but idle and iowait; guest time is already inside user and nice."""
    lines = {}
    for line in stat.splitlines():
        if not line.startswith("cpu"):
            break  # the cpu lines come first
        fields = line.split()
        lines[fields[0]] = fields
    listed = sum(1 for name in lines if name != "cpu")
    if cpus is None or len(cpus) >= listed:
        names, count = ["cpu"], listed
    else:
        names, count = [f"cpu{c}" for c in cpus], len(cpus)
    if count == 0:
        return None
    busy = 0
    for name in names:
        fields = lines.get(name)
        if fields is None or len(fields) < 6:
            return None
        ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, count


class HostLoad:
    """Cores that other processes kept busy between the previous look and this one, out of the
    CPUs this process may use. The readers are parameters so tests can fake them."""

    def __init__(
        self,
        read_stat=_read_proc_stat,
        own_cpu_s=time.process_time,
        clock=time.monotonic,
        cpus: list[int] | None = None,
        ticks_per_s: int | None = None,
    ):
        self._read_stat, self._own_cpu_s, self._clock = read_stat, own_cpu_s, clock
        self._cpus = _own_cpus() if cpus is None else cpus
        self._ticks_per_s = ticks_per_s or _clock_ticks()
        self.cores: int | None = None  # CPUs counted, once a look has read /proc/stat
        self._last = None  # (wall s, busy ticks, own CPU s) of the look the next one compares with
        self._estimate: float | None = None
        self.others_busy_cores()  # the baseline: the first forward then compares with import time

    def others_busy_cores(self) -> float | None:
        """Other processes' busy cores, averaged since the previous estimate (0.0 .. cores); None
        while unknown (no /proc/stat). engine.model.cpu_threads looks at every forward, so while
        completions run the interval is about MIN_INTERVAL_S. The first look after an idle spell
        averages over the whole spell and so may miss a neighbour that started just before;
        without a background thread nothing fresher exists, a long-running neighbour dominates
        the average anyway, and the next look (~50 ms on, in the same completion) sees it."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < MIN_INTERVAL_S:
            return self._estimate
        try:
            read = busy_ticks(self._read_stat(), self._cpus)
        except (OSError, ValueError):
            read = None
        if read is None:
            self._last, self._estimate = None, None
            return None
        busy, self.cores = read
        own = self._own_cpu_s()
        if self._last is not None:
            wall_s, busy_before, own_before = self._last
            others_s = (busy - busy_before) / self._ticks_per_s - (own - own_before)
            self._estimate = min(max(others_s / (now - wall_s), 0.0), float(self.cores))
        self._last = (now, busy, own)
        return self._estimate


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


_host = HostLoad()


def others_busy_cores() -> tuple[float, int] | None:
    """(other processes' busy cores, cores this process may use), this process's estimate (see
    HostLoad.others_busy_cores); None while unknown."""
    others = _host.others_busy_cores()
    return None if others is None else (others, _host.cores)
