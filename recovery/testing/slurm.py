"""A real Slurm cluster on this host, for tests: one slurmctld and one slurmd per node, each node a slurmd of its
own on a port of its own (`NodeHostname=localhost Port=...`, which Debian's build allows), all state in a directory.

    cluster = SlurmCluster(tmp_path / "slurm", nodes=["n1", "n2", "n3"])
    cluster.start()               # returns once every node is idle
    job = cluster.sbatch(script, "-N", "2", "--requeue")
    cluster.wait_job(job, lambda j: j["JobState"] == "RUNNING", 30, "the job to run")
    cluster.stop()                # cancels the jobs, stops every daemon by its pid, and whatever they left behind

Needs Debian's `slurmctld` and `slurmd` packages (`apt-get install slurmctld slurmd`) and root, since slurmd runs
jobs as their users. Authentication is `auth/none`: every process here is this host's own, and munge would be one
more daemon (and key) to run for nothing.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from recovery.log.nats_server import free_port
from recovery.slurm.scontrol import parse_record

__all__ = ["SlurmCluster", "SlurmMissing"]

POLL_S = 0.1


class SlurmMissing(RuntimeError):
    """The Slurm daemons are not installed."""


def _binary(name: str) -> str:
    found = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)),
                                       None)
    if found is None:
        raise SlurmMissing(f"{name} is not installed: apt-get install -y slurmctld slurmd (Debian's packages)")
    return found


class SlurmCluster:
    def __init__(self, base_dir: str | os.PathLike[str], nodes: list[str] | None = None, *, cpus_per_node: int = 1,
                 kill_wait_s: int = 10, requeue_delay_s: int = 5) -> None:
        """`kill_wait_s`: between the SIGTERM and the SIGKILL of an ending job's processes (Slurm's KillWait).
        `requeue_delay_s`: how long a requeued job waits before it may start again (Slurm holds it for the job
        credential's lifetime, `cred_expire`, 120 s unless set)."""
        self.base_dir = Path(base_dir).resolve()
        self.nodes = list(nodes or ["n1", "n2", "n3"])
        self.cpus_per_node = cpus_per_node
        self.kill_wait_s = kill_wait_s
        self.requeue_delay_s = requeue_delay_s
        self.conf = self.base_dir / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    # -- configuration ---------------------------------------------------------------------------------
    def _write_conf(self) -> None:
        for sub in ("state", "spool", "run", "log"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (self.base_dir / "spool" / node).mkdir(exist_ok=True)
        user = getpass.getuser()
        self.ports = {"slurmctld": free_port(), **{node: free_port() for node in self.nodes}}
        d = self.base_dir
        lines = [
            f"ClusterName=recovery{os.getpid()}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={self.ports['slurmctld']}",
            f"SlurmdPort={self.ports[self.nodes[0]]}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/none",
            "CredType=cred/none",
            f"AuthInfo=cred_expire={self.requeue_delay_s}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/pgid",  # no cgroup hierarchy to own in a container
            "TaskPlugin=task/none",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",  # a requeued job starts once eligible, not a minute later
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            f"KillWait={self.kill_wait_s}",
            "InactiveLimit=0",
            "MinJobAge=600",  # an ended job stays visible to `scontrol show job` for the test to read
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={self.ports[node]} "
                         f"CPUs={self.cpus_per_node} State=UNKNOWN")
        lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    # -- processes -------------------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> None:
        out = (self.base_dir / "log" / f"{name}.out").open("ab")
        with out:
            self.procs[name] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                env={**os.environ, **self.env}, start_new_session=True)

    def start(self, timeout: float = 60.0) -> None:
        """Start slurmctld and every slurmd; return once every node is idle. Raises with the daemons' logs if one
        exits or the nodes are not idle by the deadline (and stops what it started)."""
        slurmctld, slurmd = _binary("slurmctld"), _binary("slurmd")
        self._write_conf()
        try:
            self._spawn("slurmctld", [slurmctld, "-D", "-f", str(self.conf)])
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", [slurmd, "-D", "-f", str(self.conf), "-N", node])
            self.wait(lambda: self.idle() == set(self.nodes), timeout, "every node to be idle")
        except BaseException:
            self.stop()
            raise

    def idle(self) -> set[str]:
        with contextlib.suppress(RuntimeError):
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=5)
            return {name for name, state in (line.split() for line in out.splitlines() if line.strip())
                    if state == "idle"}
        return set()

    def _check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs()}")

    def wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `condition` until it holds; raise (with the daemons' logs) at the deadline or if a daemon died."""
        deadline = time.monotonic() + timeout
        while not condition():
            self._check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}:\n{self.logs()}")
            time.sleep(POLL_S)  # polling interval of a deadline-bounded wait

    def logs(self, lines: int = 20) -> str:
        parts = []
        for path in sorted((self.base_dir / "log").glob("*")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def stop(self, timeout: float = 20.0) -> None:
        """Cancel every job, wait for them to end, then stop every slurmd and slurmctld by pid (SIGTERM, then SIGKILL
        at the deadline); last, kill by pid whatever still runs with this cluster's configuration (a job step whose
        slurmd is gone, a batch script that ignored its SIGTERM)."""
        with contextlib.suppress(RuntimeError, OSError):
            jobs = self.run("squeue", "-h", "-o", "%A", timeout=5).split()
            if jobs:
                self.run("scancel", *jobs, timeout=5)
                deadline = time.monotonic() + self.kill_wait_s + 10
                while self.run("squeue", "-h", "-o", "%A", timeout=5).split() and time.monotonic() < deadline:
                    time.sleep(POLL_S)  # polling the jobs' end, within the deadline
        daemons = [n for n in self.procs if n != "slurmctld"] + (["slurmctld"] if "slurmctld" in self.procs else [])
        for name in daemons:
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def leftovers(self) -> list[int]:
        """Processes that carry this cluster's SLURM_CONF: started by its daemons (job steps, batch scripts and
        what they ran), found by pid."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- Slurm's commands ------------------------------------------------------------------------------
    def run(self, *args: str, timeout: float = 30.0, env: dict[str, str] | None = None) -> str:
        """A Slurm command against this cluster; RuntimeError with its output if it fails."""
        done = subprocess.run([_binary(args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {}), **self.env}, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited with {done.returncode}: {done.stderr or done.stdout}")
        return done.stdout

    def sbatch(self, script: str | os.PathLike[str], *args: str, env: dict[str, str] | None = None) -> str:
        """Submit a batch script; its job id."""
        return self.run("sbatch", "--parsable", *args, str(script), env=env).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        return parse_record(self.run("scontrol", "-o", "show", "job", job_id).strip())

    def node(self, name: str) -> dict[str, str]:
        return parse_record(self.run("scontrol", "-o", "show", "node", name).strip())

    def wait_job(self, job_id: str, condition: Callable[[dict[str, str]], bool], timeout: float, what: str) -> None:
        self.wait(lambda: condition(self.job(job_id)), timeout, what)
