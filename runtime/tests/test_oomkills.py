"""Where the container's OOM kills are read (the real cgroup v1 kill is
``tests/test_oom.py``'s; cgroup v2's files, which this machine has not, are laid out here)."""

from __future__ import annotations

from pathlib import Path

from worker_runtime.oomkills import OomKills, counter_files, read_count


def test_cgroup_v1_and_v2_lines_name_their_counter_then_the_mounts_root(tmp_path: Path) -> None:
    v1 = "12:pids:/\n4:memory:/kubepods/pod1/abc\n0::/\n"
    assert counter_files(v1, tmp_path) == [
        tmp_path / "memory/kubepods/pod1/abc/memory.oom_control",
        tmp_path / "memory/memory.oom_control",
        tmp_path / "memory.events",
        tmp_path / "memory.events",
    ]
    v2 = "0::/kubepods.slice/pod1.scope\n"
    assert counter_files(v2, tmp_path) == [
        tmp_path / "kubepods.slice/pod1.scope/memory.events",
        tmp_path / "memory.events",
    ]


def test_the_count_is_the_kills_since_it_was_made_and_zero_without_a_counter(
    tmp_path: Path,
) -> None:
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 3\noom_group_kill 0\n")
    assert read_count(events) == 3
    kills = OomKills(events)
    assert kills.total() == 0
    events.write_text("low 0\nhigh 0\nmax 15\noom 5\noom_kill 5\noom_group_kill 0\n")
    assert kills.total() == 2
    (metric,) = kills.collect()
    assert metric.name == "worker_oom_kills" and metric.samples[0].value == 2
    assert OomKills(tmp_path / "missing").total() == 0
    assert read_count(tmp_path / "missing") is None
