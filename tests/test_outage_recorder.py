"""The daemon's record of its own outage (`recovery.service.outage`): held while the connection is down, published
once it is back (one `control.outage` per watched job, sealed), again if the connection was lost meanwhile, and
before the timer service fires anything (`TimerService.gate`). Kept in the data directory until it is logged, so
that the daemon started after a deposed one logs it; a standby logs the outage it saw only if it takes the partition
soon after."""

from __future__ import annotations

from pathlib import Path

import anyio
import orjson
import pytest

from recovery.service import config as config_mod
from recovery.service.daemon import Daemon
from recovery.service.outage import OutageRecorder, pending_path, takeover_window_s
from recovery.service.publisher import Outgoing
from recovery.testing.scenario import Scenario


class Link:
    """A connection the test opens and cuts, a process's monotonic clock and the wall clock it moves, and what was
    published. `restarted` is the next process's: its monotonic clock starts anew, the wall clock goes on."""

    def __init__(self, now: float = 100.0, wall_s: float = 1_800_000_000.0) -> None:
        self.up = True
        self.now = now
        self.wall_offset = wall_s - now
        self.sent: list[list[Outgoing]] = []
        self.fail: list[BaseException] = []
        self.on_publish: list[object] = []

    def wall(self) -> int:
        return int((self.now + self.wall_offset) * 1e9)

    def restarted(self, after_s: float) -> Link:
        return Link(now=7.0, wall_s=self.now + self.wall_offset + after_s)


def recorder(s: Scenario, link: Link, path: Path | None = None, active: bool = True) -> OutageRecorder:
    async def publish(out: list[Outgoing]) -> None:
        if link.on_publish:
            link.on_publish.pop(0)()  # type: ignore[operator]
        if link.fail:
            raise link.fail.pop(0)
        link.sent.append(out)

    return OutageRecorder(lambda: s.engine, publish, lambda ident: f"{ident}~sealed", 300.0, lambda: link.up,
                          lambda: True, clock=lambda: link.now, wall=link.wall, path=path,
                          window_s=takeover_window_s(10.0), active=active)


def away(link: Link) -> list[float]:
    return [orjson.loads(out[0].data)["data"]["away_s"] for out in link.sent]


def two_jobs() -> Scenario:
    s = Scenario()
    s.submit("running", ["n0"], ranks_per_node=1, dp=1)
    s.submit("waiting", ["n1"], ranks_per_node=1, dp=1, start=False)  # not started: no silence to judge
    return s


async def test_an_outage_is_logged_once_the_connection_is_back_for_each_watched_job() -> None:
    s, link = two_jobs(), Link()
    outage = recorder(s, link)
    await outage.clear()  # nothing to log: the gate is open
    assert link.sent == []
    outage.disconnected()
    link.now += 90
    link.up = True
    await outage.clear()
    [[message]] = link.sent
    envelope = orjson.loads(message.data)
    assert message.subject == "recovery.ev.job.running.control.outage"
    assert envelope["data"] == {"away_s": 90.0, "bound_s": 300.0}
    assert message.msg_id == f"{envelope['id']}~sealed" and message.kind == "input"
    assert not outage.pending


async def test_a_record_not_acknowledged_or_cut_off_again_is_sent_again_whole() -> None:
    s, link = two_jobs(), Link()
    outage = recorder(s, link)
    outage.disconnected()
    link.now += 10
    link.fail.append(TimeoutError())  # not acknowledged in time

    def cut_again() -> None:  # the connection drops while the record goes out, and is back 5 s later
        outage.disconnected()
        link.now += 5

    link.on_publish.extend([lambda: None, cut_again])
    await outage.clear()
    first, second = (orjson.loads(out[0].data) for out in link.sent)
    assert first["data"]["away_s"] == 10.0 and second["data"]["away_s"] == 15.0
    assert first["id"] != second["id"], "a record of the whole outage must not be dropped as the first's duplicate"
    assert not outage.pending


async def test_an_outage_that_deposed_its_daemon_is_logged_by_the_next_one_on_its_data_directory(
        tmp_path: Path) -> None:
    """The daemon loses its lease in the outage and stops before it logs it; its supervisor starts it again: the new
    process finds the outage in the data directory, measures it on the wall clock up to its record, and logs it
    (under the ids the first one would have used) before its timers; the file goes once the record is in."""
    s, link = two_jobs(), Link()
    path = pending_path(tmp_path, "default")
    deposed = recorder(s, link, path)
    deposed.disconnected()
    assert path.exists() and not list(tmp_path.glob("*.tmp")), "kept at the cut, whole"
    link.now += 8
    deposed.reconnected()  # and deposed: it stops without a record
    kept = orjson.loads(path.read_bytes())
    assert kept["cuts"] == 1 and kept["back_wall_ns"] - kept["since_wall_ns"] == 8 * 10**9

    successor_link = link.restarted(after_s=3)
    successor = recorder(s, successor_link, path, active=False)
    successor.recover()
    successor.took_over()
    assert successor.pending
    successor_link.now += 1.5  # its start and replay
    await successor.clear()
    assert away(successor_link) == [12.5]  # 8 s of outage, 3 s to the new process, 1.5 s in it
    [[message]] = successor_link.sent
    assert orjson.loads(message.data)["id"] == f"outage:running:{kept['since_wall_ns']}:1"
    assert not path.exists() and not successor.pending


async def test_a_daemon_stopped_in_the_outage_leaves_it_to_the_next_one_which_measures_it_to_its_record(
        tmp_path: Path) -> None:
    """Killed (or stopped) while NATS is away, the daemon never sees NATS again: the outage ended, as far as this
    data directory knows, when the next daemon connected."""
    s, link = two_jobs(), Link()
    path = pending_path(tmp_path, "p-3")
    recorder(s, link, path).disconnected()
    successor_link = link.restarted(after_s=20)
    successor = recorder(s, successor_link, path, active=False)
    successor.recover()
    successor_link.now += 40  # a takeover after the window, counted from its own connection: dropped
    successor.took_over()
    assert not successor.pending and not path.exists()
    await successor.clear()
    assert successor_link.sent == []


@pytest.mark.parametrize("content", [
    b"{not json", b"[1, 2]", b'{"since_wall_ns": "yesterday", "cuts": 1}', b'{"since_wall_ns": 1, "cuts": 0}',
    b'{"since_wall_ns": 9999999999999999999, "cuts": 1, "back_wall_ns": null}'])
async def test_an_unreadable_kept_outage_is_dropped_and_holds_no_timer(tmp_path: Path, content: bytes) -> None:
    s, link = two_jobs(), Link()
    path = pending_path(tmp_path, "default")
    path.write_bytes(content)
    outage = recorder(s, link, path, active=False)
    outage.recover()
    outage.took_over()
    with anyio.fail_after(5):
        await outage.clear()
    assert link.sent == [] and not path.exists()


async def test_a_kept_outage_past_the_bound_is_dropped_it_would_excuse_nothing(tmp_path: Path) -> None:
    """A file from long ago (a daemon that crashed in an outage and ran again only days later): the engine counts
    the silence of an outage past the bound anyway, so there is nothing to log and nothing to wait for."""
    s, link = two_jobs(), Link()
    path = pending_path(tmp_path, "default")
    old = recorder(s, link, path)
    old.disconnected()
    link.now += 5
    old.reconnected()
    successor_link = link.restarted(after_s=3 * 24 * 3600)
    successor = recorder(s, successor_link, path, active=False)
    successor.recover()
    successor.took_over()
    with anyio.fail_after(5):
        await successor.clear()
    assert successor_link.sent == [] and not path.exists()


async def test_a_standby_cut_off_in_the_outage_logs_it_when_it_takes_the_partition_soon_after() -> None:
    """After an outage of all of NATS the active daemon may be deposed, and the standby that takes the lease saw
    the same outage: it logs it, measured from its own cut to its record."""
    s, link = two_jobs(), Link()
    standby = recorder(s, link, active=False)
    standby.disconnected()
    link.now += 7
    standby.reconnected()
    link.now += 2  # the deposed daemon's key is free: taken
    standby.took_over()
    await standby.clear()
    assert away(link) == [9.0]


async def test_a_standby_that_takes_the_partition_long_after_an_outage_logs_nothing() -> None:
    """The daemon that held the partition through the outage logged it; the standby takes over much later (that
    daemon was stopped): the old outage is not news, and a record would excuse silence another daemon judged."""
    s, link = two_jobs(), Link()
    standby = recorder(s, link, active=False)
    standby.disconnected()
    link.now += 7
    standby.reconnected()
    link.now += takeover_window_s(10.0) + 1
    standby.took_over()
    assert not standby.pending
    await standby.clear()
    assert link.sent == []


async def test_a_standby_outage_long_over_is_not_counted_in_the_next_one() -> None:
    s, link = two_jobs(), Link()
    standby = recorder(s, link, active=False)
    standby.disconnected()
    link.now += 7
    standby.reconnected()
    link.now += 3600
    standby.disconnected()
    link.now += 4
    standby.reconnected()
    standby.took_over()
    await standby.clear()
    assert away(link) == [4.0]


async def test_the_active_daemon_logs_its_outage_however_late_it_can() -> None:
    """The window is a taking-over daemon's rule: the daemon that held the partition logs its own outage once its
    lease is fresh again, however long that took."""
    s, link = two_jobs(), Link()
    active = recorder(s, link)
    active.disconnected()
    link.now += 7
    active.reconnected()
    link.now += takeover_window_s(10.0) + 1
    active.took_over()  # (it held the partition all along)
    await active.clear()
    assert len(link.sent) == 1


async def test_a_standby_daemon_keeps_the_outage_it_saw_and_a_stopping_one_sees_none(tmp_path: Path) -> None:
    """The daemon's wiring: a standby's lost connection is an outage, kept in its data directory; the connection a
    stopping daemon closes itself is not."""
    cfg = config_mod.load(nats_url="nats://127.0.0.1:1", http_port=-1, data_dir=tmp_path / "data", lease_ttl_s=2.0)
    cfg.data_dir.mkdir()  # as the daemon's start does, when it takes the directory's lock
    standby = Daemon(cfg)
    standby.role = "standby"
    await standby._on_disconnected()
    path = pending_path(cfg.data_dir, standby.key)
    assert standby.outage.pending and path.exists()
    await standby._on_reconnected()
    assert orjson.loads(path.read_bytes())["back_wall_ns"] is not None
    path.unlink()
    stopping = Daemon(cfg)
    stopping.role = "active"
    stopping.request_stop()
    await stopping._on_disconnected()
    assert not stopping.outage.pending and not path.exists()
