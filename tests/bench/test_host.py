"""Host load recorded beside every benchmark: steal share from /proc/stat, load average."""

from __future__ import annotations

import pytest

from stallfree.bench.host import CpuTimes, HostWatch, describe, shares

# /proc/stat's aggregate line: user nice system idle iowait irq softirq steal guest guest_nice.
STAT = "cpu  {u} 0 {s} {i} {w} 0 0 {st} 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1 2 3\n"


def stat(u: int, s: int, i: int, w: int, st: int) -> str:
    return STAT.format(u=u, s=s, i=i, w=w, st=st)


def test_parse_reads_the_aggregate_line_and_leaves_guest_out():
    t = CpuTimes.parse(stat(100, 50, 800, 20, 30))
    assert (t.total, t.idle, t.steal) == (1000, 820, 30)  # guest (7) is inside user already
    with pytest.raises(ValueError, match="cpu"):
        CpuTimes.parse("intr 1 2 3\n")


def test_shares_over_an_interval():
    a = CpuTimes.parse(stat(100, 50, 800, 20, 30))
    b = CpuTimes.parse(stat(350, 100, 1400, 20, 130))  # 1000 ticks: 300 busy, 600 idle, 100 stolen
    assert shares(a, b) == pytest.approx({"steal_share": 0.10, "busy_share": 0.30})
    assert shares(a, a) is None  # no time passed: no share to report


def test_watch_reports_a_disturbed_span(tmp_path):
    f = tmp_path / "stat"
    f.write_text(stat(100, 50, 800, 20, 30))
    quiet = HostWatch(f)
    f.write_text(stat(600, 150, 1190, 20, 40))  # 1000 ticks, 10 stolen: 1%
    q = quiet.summary()
    assert q["steal_share"] == pytest.approx(0.01) and not q["disturbed"]
    assert set(q["loadavg_1m"]) == {"before", "after"}
    f.write_text(stat(100, 50, 800, 20, 30))
    busy = HostWatch(f)
    f.write_text(stat(400, 150, 1300, 20, 130))  # 1000 ticks, 100 stolen: 10%
    b = busy.summary()
    assert b["disturbed"] and "host disturbed" in describe(b) and "steal 10.0%" in describe(b)
    # Without /proc/stat (not Linux) only the load average is kept, and nothing claims a steal share.
    none = HostWatch(tmp_path / "missing").summary()
    assert "steal_share" not in none and "disturbed" not in none and describe(none).startswith("load ")


def test_this_machine_reads():
    t = CpuTimes.read()
    if t is None:
        pytest.skip("no /proc/stat here")
    s = HostWatch().summary()
    assert "loadavg_1m" in s
    if "steal_share" in s:  # the two reads may fall in the same clock tick
        assert 0.0 <= s["steal_share"] <= 1.0 and 0.0 <= s["busy_share"] <= 1.0
