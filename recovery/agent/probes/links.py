"""The link state of the node's configured interfaces, from `/sys/class/net/<interface>/operstate`, as
`network.link_down` and `network.link_up` events; the interface's name is the event's `link`.

Which operational states (RFC 2863, as Linux reports them) count as down:

- `up`: up.
- `unknown`: up. The driver does not report an operational state (loopback, many virtual devices), and the
  kernel's operstates document says such an interface "must be considered for user data", as routing daemons
  and DHCP clients do.
- `down`, `lowerlayerdown`: down. Administratively down or without carrier (unplugged, the switch port or the
  peer gone); `lowerlayerdown` is the same for an interface stacked on another (a VLAN, a veth whose peer is down).
- `notpresent`, `testing`, `dormant`: down. The interface passes no ordinary traffic now (`dormant`: it waits for
  an external event such as 802.1X authentication).
- a missing interface, an unreadable or empty operstate file, any other value: down. What cannot be seen to
  work is down.

`/sys/class/net` shows the interfaces of the network namespace sysfs was mounted in, which is why the agent
must run in the namespace of the interfaces it watches (the host's, for a node agent).

A watcher sees states, not transitions: a link that goes down and comes back between two polls goes unseen.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from events.kinds import LinkDown, LinkUp

SYS_CLASS_NET = Path("/sys/class/net")
UP_STATES = frozenset({"up", "unknown"})
"""operstates that count as up; every other value, and a missing interface, counts as down"""
MISSING = "missing"
"""the state recorded for an interface whose operstate cannot be read"""


def is_up(operstate: str) -> bool:
    """Whether an interface in this operational state counts as up (see the module's table)."""
    return operstate in UP_STATES


@dataclass(frozen=True, slots=True)
class LinkChange:
    """A configured link went down or came up: the event, and the operstate that showed it."""

    type: Literal["network.link_down", "network.link_up"]
    event: LinkDown | LinkUp
    operstate: str
    """what sysfs said (`missing` when the interface or its operstate file is gone)"""

    def data(self) -> dict[str, Any]:
        """The event's `data` as it goes on the wire."""
        return self.event.model_dump(mode="json")


class LinkWatcher:
    """Reports the configured links' transitions between up and down since the last poll.

    The caller polls at its own interval. The first poll reports every link that is down then (the control plane
    takes a link to be up until told otherwise) and nothing about the links that are up.
    """

    def __init__(self, interfaces: Iterable[str], root: str | os.PathLike[str] = SYS_CLASS_NET) -> None:
        """`interfaces`: network interface names (`eth0`, `ib0`, `mlx5_0` as a netdev); `root`: where the
        interfaces' sysfs directories are (a fake tree in tests)."""
        self.interfaces = tuple(dict.fromkeys(interfaces))
        for name in self.interfaces:
            if not name or "/" in name or name in (".", "..") or not name.isprintable():
                raise ValueError(f"not a network interface name: {name!r}")
        self.root = Path(root)
        self.up: dict[str, bool] = {}
        """each link's state at the last poll (none before the first)"""

    def operstate(self, interface: str) -> str:
        """What `<root>/<interface>/operstate` says now, or `missing`."""
        try:
            return (self.root / interface / "operstate").read_text().strip() or MISSING
        except OSError:
            return MISSING

    def poll(self) -> list[LinkChange]:
        """The links that went down or came up since the last poll, in the order they were configured."""
        changes: list[LinkChange] = []
        for name in self.interfaces:
            state = self.operstate(name)
            up = is_up(state)
            before = self.up.get(name, True)
            self.up[name] = up
            if up == before:
                continue
            if up:
                changes.append(LinkChange("network.link_up", LinkUp(link=name), state))
            else:
                changes.append(LinkChange("network.link_down", LinkDown(link=name), state))
        return changes
