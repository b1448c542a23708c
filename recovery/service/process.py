"""The `recovery-daemon` process around one unpartitioned `Daemon`: the hot path's tuning, SIGTERM and SIGINT as a
graceful stop, `duration_s`, and the collector's freeze of the restored state (`recovery.service.ownership` does
the same for a partitioned one)."""

from __future__ import annotations

import asyncio
import logging
import signal

import anyio
from anyio.abc import TaskStatus

from recovery.service import connection, speedups
from recovery.service.config import DaemonConfig
from recovery.service.daemon import Companion, Daemon, DaemonFailed
from recovery.service.datadir import StartRefused

logger = logging.getLogger("recovery.daemon")


async def _stop_on_signals(daemon: Daemon) -> None:
    try:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                daemon.request_stop()
    except (NotImplementedError, RuntimeError, ValueError):
        return  # no signal handlers here (another platform, or not the main thread)


async def _stop_after(daemon: Daemon, seconds: float) -> None:
    await anyio.sleep(seconds)
    daemon.request_stop()


async def run(cfg: DaemonConfig, companion: Companion | None = None) -> int:
    """Run a daemon until SIGTERM/SIGINT (or `duration_s`); 0 on a clean stop, 1 if it failed, 2 if it was refused
    at start (its data directory another daemon's, its embedded server's port held)."""
    tuned = speedups.apply()
    asyncio.get_running_loop().set_default_executor(connection.ShortLivedThreads())
    daemon = Daemon(cfg)

    async def serve(*, task_status: TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await daemon.run(companion, task_status=task_status)
        except DaemonFailed:
            pass  # logged where it failed
        except Exception:
            daemon.failed = True
            logger.exception("daemon failed")
        finally:
            group.cancel_scope.cancel()  # the signal relay and the duration end with the daemon

    async with anyio.create_task_group() as group:
        group.start_soon(_stop_on_signals, daemon, name="recovery-signals")
        if cfg.duration_s is not None:
            group.start_soon(_stop_after, daemon, cfg.duration_s, name="recovery-duration")
        await group.start(serve, name="recovery-daemon")
        if not daemon.stopping:
            speedups.freeze()  # the restored state is long-lived: keep it out of later collections
            logger.info("tuned", extra={"fields": {"applied": tuned}})
    if isinstance(daemon.failure, StartRefused):
        return 2
    return 1 if daemon.failed else 0
