"""The agent's configuration: defaults < TOML file < environment (`RECOVERY_AGENT_<KEY>`) < command-line flags.

    recovery-agent --node gpu-17 --nats-url nats://nats-0:4222
    RECOVERY_AGENT_NODE=gpu-17 recovery-agent --config /etc/recovery/agent.toml

An unknown key or a bad value stops the agent at start with an error that names the key and where it came from.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from events.subjects import check_token
from recovery import settings
from recovery.agent.reset import DEFAULT_COMMAND as DEFAULT_RESET_COMMAND
from recovery.settings import ConfigError, FileSettings

__all__ = ["ENV_PREFIX", "AgentConfig", "CommandCheck", "ConfigError", "add_arguments", "load"]

ENV_PREFIX = "RECOVERY_AGENT_"


class CommandCheck(BaseModel):
    """One of the platform's own health checks (as Slurm's NHC or node-problem-detector scripts are run)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:/-]+$",
                      description="how `node.checked` names it")
    command: str = Field(min_length=1, description="a shell command line: exit 0 passes")
    budget_s: float = Field(30.0, gt=0, le=3600, description="killed, and failed, past this many seconds")


class AgentConfig(FileSettings):
    """Every setting of `recovery-agent`. Descriptions double as `--help` text."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    node: str = Field(description="this node's id, as job specs name it (one subject token)")
    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated")
    nats_inbox_prefix: str = Field("_INBOX", pattern=r"^[A-Za-z0-9_\-]+$",
                                   description="where replies reach this agent: `_INBOX_<node>` under the NATS "
                                               "permissions of `python -m recovery.service.auth`, which confine "
                                               "every agent to its own inbox")
    stream: str = Field("RECOVERY", description="the audit log stream the agent publishes events to")
    command_stream: str = Field("RECOVERY_CMD", description="the stream of the commands addressed to this node")
    spare: bool = Field(False, description="join the shared spare pool instead of reporting ready")
    pool: str | None = Field(None, pattern=r"^[^.*>\s]+$",
                             description="with `spare`: the spare pool to join instead of the shared one, kept for "
                                         "the jobs whose `spare_pool` names it")
    devices: int = Field(8, ge=1, le=1024, description="accelerators (rank slots) of this node")
    runtime_dir: Path = Field(Path("recovery-agent"), description="the SDK's sockets and the ranks' output")
    memory_dir: Path = Field(Path("/dev/shm"), description="where the in-memory checkpoint tier keeps the ranks' "
                                                           "checkpoints (tmpfs: the node's RAM, which outlives the "
                                                           "processes), in a directory of this agent's, removed at "
                                                           "each job's end")
    heartbeat_s: float = Field(1.0, gt=0, le=60, description="how often the SDK in every rank sends a heartbeat")
    node_heartbeat_s: float = Field(1.0, gt=0, le=60, description="how often the agent says it is alive "
                                                                  "(`node.heartbeat`)")
    liveness: Literal["log", "live"] = Field("log", description="how the agent says it is alive: `log`, a "
                                                                 "`node.heartbeat` in the log every "
                                                                 "`node_heartbeat_s` it did not report in; `live`, a "
                                                                 "beat on core NATS (`recovery.live.<node>`) every "
                                                                 "`node_heartbeat_s`, which the daemon's liveness "
                                                                 "monitor watches, the log holding only the mode "
                                                                 "(once) and the node's silences (daemons first: "
                                                                 "one that predates the mode refuses it)")
    progress: Literal["log", "summary"] = Field("log", description="where the ranks' periodic reports go: `log`, "
                                                 "into the log, one `progress.report` a job every `report_s`; "
                                                 "`summary`, on core NATS (`recovery.progress.<node>`) to the daemon, "
                                                 "which logs one `progress.summary` per job every "
                                                 "`progress_summary_s`; news (a rank's first word or step in a "
                                                 "generation, a high loss, the fold before a change) goes into the "
                                                 "log at once either way (daemons first: one that predates it hears "
                                                 "no report, and would find the ranks silent)")
    report_s: float = Field(1.0, ge=0, le=60, description="how often the ranks' heartbeats and steps of each job "
                                                           "go out folded into one `progress.report`; 0: each on "
                                                           "its own, as older agents send them")
    job_reports_per_s: float = Field(8192.0, gt=0, description="the reports a second all the agents of one job send "
                                                                "together at most: a job of more nodes than this "
                                                                "reports less often than `report_s` (16,384 nodes: "
                                                                "every 2 s), so that one job costs its daemon half a "
                                                                "core at most")
    rank_silence_s: float = Field(8.0, ge=0, le=3600, description="a rank whose SDK spoke and then said nothing "
                                                                   "this long is reported hung (`process.hang`); "
                                                                   "0: the engine's watchdog alone finds it")
    step_hook: bool = Field(True, description="start the ranks with the hook that counts their optimizer steps "
                                              "(`recovery.client.steps`): a script without the SDK is timed to its "
                                              "first step after a restart; a job turns it off with "
                                              "RECOVERY_STEP_HOOK=0 in its environment")
    ending_alive_s: float = Field(120.0, ge=0, le=3600, description="a rank whose SDK said its script is done or "
                                                                     "its interpreter is exiting sends no heartbeat "
                                                                     "while its process ends (torch's teardown takes "
                                                                     "seconds on a loaded host): the agent says it "
                                                                     "lives this long at most, then it is silent "
                                                                     "again")
    stock_stopped_s: float = Field(10.0, ge=0, le=3600, description="a rank of a script without the SDK whose "
                                                                     "process is stopped (state T: SIGSTOP) this "
                                                                     "long is reported hung; 0: not watched")
    stock_hang_s: float = Field(45.0, ge=0, le=3600, description="a rank of a script without the SDK whose CPU time, "
                                                                  "I/O and stack stay still this long, outside a "
                                                                  "collective while a peer on the node waits in one, "
                                                                  "is reported hung; 0: not watched")
    hang_poll_s: float = Field(2.0, gt=0, le=60, description="how often the ranks of scripts without the SDK are "
                                                             "looked at for those hangs (/proc, and py-spy once "
                                                             "one is still)")
    outbox_capacity: int = Field(100_000, ge=1, description="events kept while NATS is away; beyond, the oldest "
                                                             "are dropped and counted")
    store_host: str = Field("0.0.0.0", description="address a rendezvous store this agent hosts listens on")
    store_wait_s: float = Field(60.0, gt=0, le=3600, description="how long a rank's start waits for the job's "
                                                                  "store (its process may still be starting) to "
                                                                  "give the torch store of the rank's formation; "
                                                                  "past it, MASTER_PORT is the job store's own")
    kill_grace_s: float = Field(5.0, ge=0, le=3600, description="how long a killed process may take to be reaped "
                                                                 "before a command fails")
    preempt_grace_s: float = Field(30.0, ge=0, le=3600, description="on SIGTERM (a preemption): how long the ranks "
                                                                    "have to save a dying checkpoint at their step "
                                                                    "boundary and then to end after SIGTERM, before "
                                                                    "SIGKILL")
    preempt_linger_s: float = Field(10.0, ge=0, le=3600, description="after stopping its ranks on SIGTERM, how long "
                                                                      "the agent stays to carry out the commands the "
                                                                      "engine sends about them")
    links: Annotated[list[str], NoDecode] = Field([], description="network interfaces whose link state is "
                                                                  "reported (comma-separated), read from "
                                                                  "sysfs_net/<interface>/operstate")
    link_poll_s: float = Field(1.0, gt=0, le=60, description="how often the links' state is read")
    sysfs_net: Path = Field(Path("/sys/class/net"), description="where the interfaces' sysfs directories are: the "
                                                                "agent's own network namespace's")
    kernel_log: Path | None = Field(None, description="follow this kernel log for NVIDIA XIDs (/dev/kmsg on a node, "
                                                      "or a file); unset: no XID probe")
    gpu_bus_ids: dict[str, int] = Field({}, description="PCI address -> device index of the node's GPUs, for XIDs "
                                                        "(JSON or a TOML table); empty: asked of nvidia-smi")
    xid_poll_s: float = Field(0.5, gt=0, le=60, description="how often the kernel log is read for XIDs")
    nvml: Literal["auto", "on", "off"] = Field("auto", description="read the GPUs' health from NVML (XID events "
                                                                  "where no kernel_log is followed, a GPU lost, "
                                                                  "ECC and row-remapping counters): auto, where "
                                                                  "NVML answers; on, or the agent does not start")
    nvml_poll_s: float = Field(2.0, gt=0, le=600, description="how often NVML is read")
    standby: bool = Field(True, description="keep warm standby interpreters per job on this node (torch imported; "
                                            "two, or one where the job has one rank here) that restarted ranks are "
                                            "handed to; a job's entrypoint environment RECOVERY_STANDBY=0, N or "
                                            "all overrides this for the job")
    standby_preload: str = Field("torch,torch.distributed,torch._dynamo,recovery.client.torch:warm_up",
                                 description="modules a standby imports before it waits, comma-separated, and "
                                             "`module:function` warm-ups it calls (a job's RECOVERY_STANDBY_PRELOAD "
                                             "overrides this)")
    standby_delay_s: float = Field(5.0, ge=0, le=3600, description="how long after a hand-over the next standby "
                                                                    "starts (its imports would compete for the CPU "
                                                                    "with the recovery's); a job's first standbys "
                                                                    "start with its ranks")
    standby_idle_s: float = Field(10.0, ge=0, le=3600, description="how long a standby imports on idle CPU time "
                                                                   "alone; one not ready by then goes on at a rank's "
                                                                   "weight (a node whose ranks keep every core busy "
                                                                   "still gets its standbys, for one import's CPU "
                                                                   "time); 0: at once")
    compile_cache: bool = Field(True, description="give each job its own compile caches on this node "
                                                  "(TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, unless the job's "
                                                  "environment names them), kept across its ranks' restarts")
    compile_cache_dir: Path | None = Field(None, description="where the jobs' compile caches are kept (default: "
                                                             "`compile-cache` in the runtime directory)")
    shared_dir: Path | None = Field(None, description="a directory every node reads and writes (a network file "
                                                      "system): the jobs' compile caches are copied there, so that "
                                                      "a spare or a new node finds what the job compiled")
    spare_standby_jobs: int = Field(1, ge=0, le=64, description="with `spare` and `standby`: for how many jobs "
                                                                 "(the newest accepted that ask for spares) this "
                                                                 "spare keeps standbys, one for each rank a node of "
                                                                 "the job runs, so that a lost node's ranks start "
                                                                 "warm here; 0: none")
    device_reset_command: str = Field(DEFAULT_RESET_COMMAND, description="how a GPU is reset before its ranks "
                                                                        "restart in place (an XID 48): a command "
                                                                        "line, `{device}` the device index; empty: "
                                                                        "this node does not reset, such a restart "
                                                                        "fails and the policy moves the ranks")
    device_reset_timeout_s: float = Field(120.0, gt=0, le=3600, description="how long a reset may take before the "
                                                                             "restart fails")
    health_check: Literal["auto", "on", "off"] = Field("auto", description="health checks before ranks land on "
                                                  "this node (at the agent's start, before a job's first ranks here, "
                                                  "before a spare takes ranks, after a fault it reports), logged as "
                                                  "`node.checked`: auto, memory, disks and `checks` everywhere, and "
                                                  "the GPU checks where a GPU is found; on, every built-in check "
                                                  "(a GPU check on a node without a GPU fails); off, none")
    checks: list[CommandCheck] = Field([], description="the platform's own health checks, run beside the built-in "
                                                       "ones: `[[checks]]` tables of `name`, `command` (run with "
                                                       "/bin/sh; exit 0 passes, its last lines are what it saw) and "
                                                       "`budget_s` (killed past it); JSON in a flag or the "
                                                       "environment")
    check_fresh_s: float = Field(300.0, ge=0, le=86400, description="how long a passing run of the health checks "
                                                                    "answers for the node (a fault it reports ends "
                                                                    "that at once); 0: every start runs them")
    check_dirs: Annotated[list[Path], NoDecode] = Field([], description="directories the ranks write to beside "
                                                                        "memory_dir, the compile caches and "
                                                                        "shared_dir, whose free space and write "
                                                                        "speed are checked (comma-separated)")
    check_min_free_memory_gb: float = Field(0.5, ge=0, description="the `memory` check: MemAvailable in GiB at "
                                                                   "least")
    check_min_free_gb: float = Field(1.0, ge=0, description="the `disk:<dir>` checks: free space in GiB at least")
    check_min_write_mb_s: float = Field(10.0, ge=0, description="the `disk:<dir>` checks: a write of 4 MiB with "
                                                                "fsync at this many MiB/s at least")
    check_budget_s: float = Field(10.0, gt=0, le=3600, description="how long the `memory`, `disk:<dir>` and "
                                                                   "`gpu-state` checks may take each before they "
                                                                   "fail")
    check_gpu_compute_budget_s: float = Field(30.0, gt=0, le=3600, description="how long the `gpu-compute` check "
                                                                               "(a process importing torch) may "
                                                                               "take before it fails")
    check_collective_budget_s: float = Field(60.0, gt=0, le=3600, description="how long the `collective` check "
                                                                              "(two processes importing torch and "
                                                                              "forming a group) may take before it "
                                                                              "fails")
    check_python: str = Field("", description="the interpreter of the `gpu-compute` and `collective` checks, one "
                                              "that imports torch (default: the agent's own)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")

    @field_validator("links", "check_dirs", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        # A flag or an environment variable lists them comma-separated (as the NATS URLs are) or as JSON.
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("checks", mode="before")
    @classmethod
    def _check_commands(cls, value: object) -> object:
        return _json_flag(value, "a JSON list of {name, command, budget_s}")

    @field_validator("checks")
    @classmethod
    def _distinct_names(cls, value: list[CommandCheck]) -> list[CommandCheck]:
        names = [check.name for check in value]
        if len(set(names)) != len(names):
            raise ValueError(f"two checks share a name: {sorted(n for n in set(names) if names.count(n) > 1)}")
        return value

    @field_validator("gpu_bus_ids", mode="before")
    @classmethod
    def _bus_ids(cls, value: object) -> object:
        return _json_flag(value, "a JSON object of PCI address -> device index")

    @field_validator("node")
    @classmethod
    def _token(cls, value: str) -> str:
        try:
            return check_token(value)
        except ValueError as exc:
            raise ValueError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per key and `--config FILE`."""
    settings.add_arguments(parser, AgentConfig)


def load(args: argparse.Namespace | None = None, **overrides: Any) -> AgentConfig:
    """The effective configuration; raises ConfigError naming the bad key and where its value came from."""
    return settings.load(AgentConfig, args, **overrides)


def _json_flag(value: object, what: str) -> object:
    """A flag's value, JSON as the environment variable's is; a file's (already a list or a table) as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not {what}: {exc}") from None
    return value
