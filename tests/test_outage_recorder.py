"""The daemon's record of its own outage (`recovery.service.outage`): held while the connection is down, published
once it is back (one `control.outage` per watched job, sealed), again if the connection was lost meanwhile, and
before the timer service fires anything (`TimerService.gate`)."""

from __future__ import annotations

import orjson

from recovery.service.outage import OutageRecorder
from recovery.service.publisher import Outgoing
from recovery.testing.scenario import Scenario


class Link:
    """A connection the test opens and cuts, a clock it moves, and what was published."""

    def __init__(self) -> None:
        self.up = True
        self.now = 100.0
        self.sent: list[list[Outgoing]] = []
        self.fail: list[BaseException] = []
        self.on_publish: list[object] = []


def recorder(s: Scenario, link: Link) -> OutageRecorder:
    async def publish(out: list[Outgoing]) -> None:
        if link.on_publish:
            link.on_publish.pop(0)()  # type: ignore[operator]
        if link.fail:
            raise link.fail.pop(0)
        link.sent.append(out)

    return OutageRecorder(lambda: s.engine, publish, lambda ident: f"{ident}~sealed", 300.0, lambda: link.up,
                          lambda: True, clock=lambda: link.now, wall=lambda: 42)


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
