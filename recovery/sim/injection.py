"""Fault injection: a fault of the mix or the trace, applied to the simulated hardware and job, and the events a real
cluster emits for it (device probes, node agents, the platform)."""

from __future__ import annotations

from functools import partial

from events.values import STORAGE_HOLDER, Tier
from policies.codes import Action, nvidia_xid
from recovery.sim.config import NS
from recovery.sim.faults import FOLLOW_UPS, Collective, CollectiveFailure, Fault, LossReport
from recovery.sim.training import LINK, TrainingState

NOT_FAULTS = ("join", "operator")
"""inputs a recorded night replays that strike nothing: a spare joining, a person's command"""
TRAINS_ON = ("straggler", "bad_step")
"""faults that stop nothing: the job trains on (slower, or from a poisoned state) until the engine acts"""


class FaultInjection(TrainingState):
    # -- faults ---------------------------------------------------------------------------------------
    def inject(self, fault: Fault) -> bool:
        """Apply a fault and emit its events. Returns whether it struck the job (its nodes or processes)."""
        node = fault.node if fault.node in self.hw else self.placement[fault.position % len(self.placement)]
        if fault.repeat and (node, fault.device) in self.replaced:
            self._count("repeats_on_replaced_devices")
            return False
        hw = self.hw[node]
        switch = fault.signal == "network" and fault.scope == "switch"
        nodes = list(self.by_switch[hw.switch]) if switch else [node]
        struck = any(n in self.placement for n in nodes) and not self.failed and fault.signal not in NOT_FAULTS
        if fault.signal == "device":
            meaning = nvidia_xid(fault.code or "79")
            if struck and self.training and meaning.action is Action.WATCH:
                # The job trains on, but the engine counts a watched code (frequency escalation may act on it): it
                # hears how far the job got first, as before any fault's events.
                self._catch_up(self.step_now())
            struck = struck and meaning.action not in (Action.IGNORE, Action.WATCH)
        if fault.signal == "bad_step":
            struck = struck and self.training  # a loss is a step's: a job that is not training reports none
        if fault.signal in NOT_FAULTS and self.training and not self.failed:
            if self.save_due == self.sched.now:
                # A persistent checkpoint due at this very instant comes first (a recorded log has them in that
                # order; the inputs it replays are scheduled before the run, so at one instant they would go first).
                self._storage_save(self._token)
            # The engine may act on it at once (a scale-out onto the spare that joined, the operator's scale), with
            # a plan that names the step its live ranks are at: it hears how far the job got first, as a real
            # engine has from the ranks' report of each step.
            self._catch_up(self.step_now())
        if struck and fault.signal not in TRAINS_ON:
            self._stop_training()
            if fault.collective is None and fault.failed_collective is None:
                self._arm_collective_timeout()
            else:  # the recorded collective timeout (`_fault_hang`) is the one this stretch of training gets
                self._ct_epoch = self._epoch
        getattr(self, f"_fault_{fault.signal}")(fault, node, nodes)
        return struck

    def _rank_on(self, node: str, device: int) -> int | None:
        if node not in self.placement:
            return None
        return self.placement.index(node) * self.rpn + device % self.rpn

    def _exit(self, rank: int, exit_code: int | None, signal: int | None) -> None:
        self.dead.add(rank)
        self.hung.discard(rank)
        self.job_event("process.exited", {"rank": rank, "exit_code": exit_code, "signal": signal,
                                          "attempt": self.generation}, source=f"agent@{self.node_of(rank)}")

    def _fault_device(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        code = fault.code or "79"
        meaning = nvidia_xid(code)
        hw = self.hw[node]
        self.node_event(node, "device.fault", {"device": fault.device, "vendor": "nvidia", "code": code,
                                               "severity": "critical"})
        follow = FOLLOW_UPS.get(code)
        if follow is not None:
            self.later(NS, lambda: self.node_event(node, "device.fault", {"device": fault.device, "vendor": "nvidia",
                                                                           "code": follow, "severity": "warning"}))
        if meaning.action in (Action.IGNORE, Action.WATCH):
            return
        if meaning.action in (Action.RESET_DEVICE, Action.ISOLATE_DEVICE, Action.ISOLATE_NODE):
            if meaning.fault_class is not None and meaning.fault_class.value == "node":
                hw.gpu_lost = fault.device
            else:
                hw.bad.add(fault.device)
            self._repair_later(node, fault.repair_ns)
        rank = self._rank_on(node, fault.device)
        if rank is not None and rank not in self.dead:
            gen = self.generation

            def crash() -> None:
                if self.generation == gen and rank not in self.dead and not self.failed:
                    # the CUDA error aborts the process (SIGABRT) unless the fault says otherwise
                    given = fault.exit_code is not None or fault.exit_signal is not None
                    self._exit(rank, fault.exit_code, fault.exit_signal if given else 6)
            self.later(int(self.cfg.agents.exit_report_s * NS), crash)

    def _fault_process(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        if node not in self.placement:
            return
        if fault.scope == "job":
            for rank in range(self.world_size):  # a dependency every rank uses is gone: all of them fail
                if rank not in self.dead:
                    self._exit(rank, 1, None)
            return
        step = self.halted_step  # where the fault stopped the job: the SIGTERM handlers save that step
        for after, shards in fault.dying:
            if after <= 0:  # saved before the exits were reported
                self._handler_save(step, shards)
        struck = self._rank_on(node, fault.device)
        if struck is not None and struck not in self.dead:
            self._exit(struck, fault.exit_code, fault.exit_signal)
        for rank in fault.exits:
            if rank < self.world_size and rank not in self.dead:
                self._exit(rank, fault.exit_code, fault.exit_signal)
        gen = self.generation
        for after, shards in fault.dying:
            if after > 0:
                self.later(after, partial(self._handler_save, step, shards, gen))

    def _handler_save(self, step: int, shards: tuple[int, ...], generation: int | None = None) -> None:
        """The exiting ranks' SIGTERM handlers saved `shards` of `step` to shared storage (a dying checkpoint nobody
        commanded), unless the job restarted or failed in between."""
        if self.failed or (generation is not None and generation != self.generation):
            return
        self.job_event("checkpoint.saved", {"step": step, "tier": Tier.DYING, "holder": STORAGE_HOLDER,
                                            "shards": list(shards)}, source="agent")

    def _fault_straggler(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        """The node computes `slowdown` times slower (a throttled GPU, a host short of CPU) for the fault's
        `repair_ns`, unless the job drains it first (a drained node is looked at before it rejoins the pool). Nothing
        is emitted: only the ranks' compute times tell of it. A recorded one slows the job by what the log measured
        (`slowdown`), and its device's rank reports `compute_slowdown` times its peers' compute time."""
        hw = self.hw[node]
        pace = hw.slowdown
        hw.slowdown = max(hw.slowdown, fault.slowdown)
        if fault.compute_slowdown is not None:  # a recorded one: its rank's compute shows it, the pace is measured
            device = fault.device % self.rpn
            hw.slow_devices[device] = max(hw.slow_devices.get(device, 1.0), fault.compute_slowdown)
        hw.slow_since = fault.index
        self._count("stragglers")
        if node in self.placement and (hw.slowdown != pace or fault.compute_slowdown is None):
            self.retime()

        def ends() -> None:
            if hw.slow_since == fault.index and (hw.slowdown > 1.0 or hw.slow_devices):
                paced = hw.slowdown > 1.0
                hw.slowdown = 1.0
                hw.slow_devices.clear()
                if node in self.placement and paced:
                    self.retime()
        self.later(fault.repair_ns, ends)

    def _fault_bad_step(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        """A loss the recorded engine took as a bad step (NaN, inf, a spike): the ranks report it as recorded, of the
        step the simulated job reached (the engine hears that step first, as from the ranks' report of each step).
        Nothing else happens: the job trains on from a poisoned state until the engine stops it."""
        if node not in self.placement or not self.training:
            return
        reached = self.step_now()
        self._catch_up(reached)
        gen = self.generation
        first = fault.losses[0].rank if fault.losses else self.world_size
        if fault.recent_losses and first < self.world_size and first not in self.dead:
            # A spike is one against the job's recent losses, which the simulated ranks report nowhere else: they
            # report the recorded ones first, of the step they are at (the engine keeps the values, not their steps).
            for loss in fault.recent_losses:
                self.job_event("progress.step", {"rank": first, "step": reached, "attempt": gen, "loss": loss},
                               source=f"agent@{self.node_of(first)}")
        for report in fault.losses:
            self.later(report.after_ns, partial(self._report_loss, report, reached, gen))

    def _report_loss(self, report: LossReport, reached: int, generation: int) -> None:
        if self.failed or self.generation != generation or report.rank >= self.world_size or report.rank in self.dead:
            return  # restarted in between: the poisoned processes are gone
        entry: dict[str, object] = {"rank": report.rank, "step": reached + report.step, "attempt": generation,
                                    "loss": report.loss}
        if report.skip:
            entry["skip"] = list(report.skip)
        if report.loss_step is None:
            self.job_event("progress.step", entry, source=f"agent@{self.node_of(report.rank)}")
            return
        entry["loss_step"] = reached + report.loss_step
        self.job_event("progress.report", {"ranks": [entry]}, source=f"agent@{self.node_of(report.rank)}")

    def _fault_hang(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        if fault.collective is not None:
            self._collective_as_recorded(fault.collective)
            return
        rank = self._rank_on(node, fault.device)
        if rank is None or rank in self.dead:
            return
        self.hung.add(rank)
        if not fault.silent:
            self._report_hang(rank)

    def _report_hang(self, rank: int) -> None:
        """The rank's agent reports it hung once it made no progress for its watchdog's time, if still hung then."""
        gen = self.generation
        delay = self.cfg.agents.hang_detect_s

        def report() -> None:
            if rank in self.hung and self.generation == gen and not self.failed:
                self.job_event("process.hang", {"rank": rank, "seconds_without_progress": delay,
                                                "attempt": gen}, source=f"agent@{self.node_of(rank)}")
        self.later(int(delay * NS), report)

    def _collective_as_recorded(self, collective: Collective) -> None:
        """A recorded collective timeout: the members that never joined hang (their agents report it as usual if
        nothing restarts them first), and after the recorded timeout the reporters say so with the recorded group.
        They do not abort: the recorded night's recovery (a retry, or a restart of the ranks that never joined) found
        them running; an exit of theirs that the log shows is a fault of its own."""
        for rank in collective.members:
            if rank < self.world_size and rank not in collective.reporters and rank not in self.dead:
                self.hung.add(rank)
                self._report_hang(rank)
        epoch, gen = self._epoch, self.generation

        def timed_out() -> None:
            if self._epoch == epoch and not self.failed:  # nothing restarted the job in between
                self.job_event("network.collective_timeout", {
                    "group": collective.group, "members": list(collective.members),
                    "reporters": list(collective.reporters), "operation": collective.operation,
                    "timeout_s": collective.timeout_s, "attempt": gen}, source="agent")
        self.later(int(collective.timeout_s * NS), timed_out)

    def _fault_collective(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        """A collective of the step under way timed out with every process alive (a recorded night's
        `process.collective_failed`): the ranks that reported it say so, of the step the job was training and of its
        group's generation then, at their recorded offsets. The processes wait for the next generation."""
        failure = fault.failed_collective
        if failure is None or node not in self.placement:
            return
        step, gen, epoch = self.halted_step + 1, self.generation, self._epoch
        # the retries of the generations the log shows failing again do not get past the step (`_maybe_resume`)
        self.failing_generations = {gen + later for _, _, later in failure.reports if later}
        for rank, after, later in failure.reports:
            self.later(after, partial(self._collective_failed, rank, step, gen + later, None if later else epoch,
                                      failure))

    def _collective_failed(self, rank: int, step: int, generation: int, epoch: int | None,
                           failure: CollectiveFailure) -> None:
        if self.failed or rank >= self.world_size or rank in self.dead or self.generation != generation:
            return  # restarted in between: that group's failure is not reported any more
        if (epoch is not None and self._epoch != epoch) or self.training or self.loading:
            return  # retried in between, and training again
        self.job_event("process.collective_failed", {
            "rank": rank, "step": step, "attempt": generation, "operation": failure.operation,
            "timeout_s": failure.timeout_s, "error": failure.error}, source=f"agent@{self.node_of(rank)}")

    def _fault_operator(self, fault: Fault, _node: str, _nodes: list[str]) -> None:
        """Not a fault: a person's command to the job (`operator.scale`, ...) at the time a recorded night shows."""
        if fault.command is not None and not self.failed:
            kind, data = fault.command
            self.job_event(kind, dict(data), source="operator")

    def _fault_join(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        """Not a fault: a spare joins the pool at the time a recorded night shows (a node added, or back from repair
        under another name)."""
        joined: dict[str, object] = {"spare": True, "devices": self.rpn}
        if fault.pool is not None:
            joined["pool"] = fault.pool
        self.node_event(node, "node.joined", joined, source="scheduler")

    def _fault_network(self, fault: Fault, node: str, nodes: list[str]) -> None:
        switch = self.hw[node].switch
        for name in nodes:
            self.hw[name].link_down = True
            self.node_event(name, "network.link_down", {"link": LINK, "switch": switch})
        if fault.outage_ns > 0:  # a switch reboot or a cable flap: the links come back by themselves
            def up() -> None:
                for name in nodes:
                    hw = self.hw[name]
                    if hw.link_down and not hw.repairing:
                        hw.link_down = False
                        self.node_event(name, "network.link_up", {"link": LINK})
                self._maybe_resume()  # restarted processes waiting in NCCL init can now connect
            self.later(fault.outage_ns, up)
            return
        # a dead NIC: the platform's health check marks the node not ready, and it waits for a repair
        def check() -> None:
            hw = self.hw[node]
            if hw.link_down and not hw.not_ready:
                hw.not_ready = True
                self.node_event(node, "node.not_ready", {"reason": f"health check: {LINK} down"}, source="k8s")
        self.later(int(self.cfg.agents.link_health_check_s * NS), check)
        self._repair_later(node, fault.repair_ns)

    def _fault_node(self, fault: Fault, node: str, _nodes: list[str]) -> None:
        hw = self.hw[node]
        hw.down = True
        self.mem_step.pop(node, None)
        if node in self.placement:
            self.dead.update(self.ranks_on(node))  # the agent dies with the host: nobody reports the exits

        def not_ready() -> None:
            if hw.down and not hw.not_ready:
                hw.not_ready = True
                self.node_event(node, "node.not_ready", {"reason": fault.component}, source="k8s")
        self.later(int(self.cfg.agents.node_not_ready_s * NS), not_ready)
        self._repair_later(node, fault.repair_ns)

