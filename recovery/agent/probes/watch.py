"""The probes running inside the agent: each polls on the agent's event loop and hands what it finds to `publish`
(the agent's `node_event`, which goes through the outbox, so nothing is lost while NATS is away).

Both are cheap to poll: the link watcher reads one small sysfs file per interface; the XID follower reads its
kernel log without blocking (`/dev/kmsg` is opened non-blocking, a file is read from where it was left).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from recovery.agent.config import AgentConfig
from recovery.agent.probes.links import LinkWatcher
from recovery.agent.probes.nvml import NvmlProbe, watch_nvml
from recovery.agent.probes.xid import PciAddress, XidFault, XidFollower, parse_nvidia_smi_bus_ids
from recovery.settings import ConfigError

logger = logging.getLogger("recovery.agent")

Publish = Callable[[str, dict[str, Any]], None]
"""publish(event type, data) of a node event"""

NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"]


async def watch_probes(links: LinkWatcher | None, xids: XidFollower | None, nvml: NvmlProbe | None,
                       publish: Publish, cfg: AgentConfig) -> None:
    """Run every probe the agent opened, each at its configured interval, until cancelled."""
    async with anyio.create_task_group() as tg:
        if links is not None:
            tg.start_soon(watch_links, links, publish, cfg.link_poll_s)
        if xids is not None:
            tg.start_soon(watch_xids, xids, publish, cfg.xid_poll_s)
        if nvml is not None:
            tg.start_soon(watch_nvml, nvml, publish, cfg.nvml_poll_s)


async def watch_links(watcher: LinkWatcher, publish: Publish, interval_s: float) -> None:
    """Publish every transition of the watched links, polling every `interval_s` (sysfs does not notify)."""
    while True:
        for change in watcher.poll():
            logger.warning("link %s: %s (operstate %s)", change.event.link, change.type, change.operstate)
            publish(change.type, change.data())
        await anyio.sleep(interval_s)  # the poll interval


async def watch_xids(follower: XidFollower, publish: Publish, interval_s: float) -> None:
    """Publish every XID the kernel logs on one of the node's GPUs as a `device.fault`; a line that names an XID
    but cannot be read as one is logged, not published (the daemon could do nothing with it)."""
    reported_lost = 0
    while True:
        found = follower.read()
        for item in found:
            if isinstance(item, XidFault):
                logger.warning("XID %s on device %s", item.event.code, item.event.device)
                publish(item.type, item.data())
            else:
                logger.warning("unreadable XID line: %s (%s)", item.line, item.reason)
        if follower.lost != reported_lost:
            logger.warning("the kernel overwrote %d log record(s) before they were read", follower.lost - reported_lost)
            reported_lost = follower.lost
        if not found:
            await anyio.sleep(interval_s)  # the poll interval; /dev/kmsg is read without blocking


def gpu_addresses(configured: dict[str, int]) -> dict[PciAddress, int]:
    """The node's GPUs by PCI address: the configured map (`gpu_bus_ids`), or else what `nvidia-smi` lists.
    ValueError when neither gives one, naming what failed."""
    if configured:
        return {PciAddress.parse(address): index for address, index in configured.items()}
    try:
        done = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"cannot map XIDs to devices: `{' '.join(NVIDIA_SMI_QUERY)}` failed ({exc}); set "
                         "gpu_bus_ids") from exc
    if done.returncode != 0:
        raise ValueError(f"cannot map XIDs to devices: `{' '.join(NVIDIA_SMI_QUERY)}` exited {done.returncode}: "
                         f"{done.stderr.strip()}; set gpu_bus_ids")
    return parse_nvidia_smi_bus_ids(done.stdout)


def open_link_watcher(interfaces: list[str], sysfs_net: Path) -> LinkWatcher | None:
    """The watcher of the configured links (none configured: None); ConfigError naming `links` for a bad name."""
    if not interfaces:
        return None
    try:
        return LinkWatcher(interfaces, root=sysfs_net)
    except ValueError as exc:
        raise ConfigError(f"invalid configuration: links: {exc}") from None


def open_xid_follower(kernel_log: Path | None, gpu_bus_ids: dict[str, int]) -> XidFollower | None:
    """The follower of the configured kernel log (unset: None), reading what is logged from now on; ConfigError
    naming the key when the log cannot be opened or the GPUs cannot be mapped."""
    if kernel_log is None:
        return None
    try:
        devices = gpu_addresses(gpu_bus_ids)
    except ValueError as exc:
        raise ConfigError(f"invalid configuration: gpu_bus_ids: {exc}") from None
    try:
        return XidFollower(devices, kernel_log)
    except OSError as exc:
        raise ConfigError(f"invalid configuration: kernel_log: cannot open {kernel_log}: {exc.strerror}") from None
