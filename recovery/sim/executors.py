"""The executors: the commands the engine sends, carried out on the simulated job after the cost model's durations
(or, replaying a recorded night, after as long as the recorded executor took), and acknowledged as real executors do
(accepted at once, then done or failed; with the configured probabilities they fail or never answer)."""

from __future__ import annotations

from functools import partial
from typing import Any

from events.commands import CommandBase
from events.values import STORAGE_HOLDER, ResumePlan, Tier
from recovery.sim.answers import DONE, FAILED, RecordedAnswer, answer_kind
from recovery.sim.config import NS
from recovery.sim.health import NodeHealth
from recovery.sim.training import _RESTARTS


class Executors(NodeHealth):
    # -- executors ------------------------------------------------------------------------------------
    def command_cost_s(self, command: CommandBase) -> float:
        c = self.cfg.costs
        kind = getattr(command, "kind", "")
        data: Any = command
        if kind == "stop_ranks":
            return c.stop_kill_s if data.mode == "kill" else min(c.stop_graceful_s, data.grace_s)
        if kind == "save_checkpoint":
            return c.dying_save_s if c.dying_save_s is not None else c.save_s(len(data.ranks), self.shard_bytes)
        if kind == "retry_step":
            return c.retry_step_s
        if kind == "restart_ranks":
            return c.restart_in_place_s + (c.device_reset_s if data.reset_devices else 0.0)
        if kind == "migrate_ranks":
            return c.migrate_s
        if kind in ("restart_job", "scale_job"):
            return c.restart_job_s(len(data.nodes))
        if kind in ("isolate_node", "isolate_device"):
            return c.isolate_s
        return c.fail_job_s

    def execute(self, command: CommandBase) -> None:
        """Carry out a command like an executor: ack `accepted` at once, then `done` (or `failed`) after its
        cost; with the configured probabilities it fails, or never answers."""
        c = self.cfg.costs
        kind = getattr(command, "kind", "")
        now = self.sched.now
        lat = int(c.ack_latency_s * NS)
        recorded = self._recorded_answer(command) if self.answers else None
        # a recorded failure is acknowledged as recorded, a recorded silence not at all (`_answer_as_recorded`)
        if recorded is None:
            self.sched.at(now + lat, lambda: self._ack(command, "accepted"))
        elif recorded.status == DONE:  # accepted as any other command is, but never after it was done
            self.sched.at(now + min(lat, int(recorded.after_s * NS)), lambda: self._ack(command, "accepted"))
        u = self.exec_rng.random()  # drawn all the same: the commands after it meet the same luck
        outcome = "failed" if u < c.fail_probability else (
            "timeout" if u < c.fail_probability + c.timeout_probability else "ok")
        if recorded is not None:
            outcome = "recorded"
        self._count(f"{kind}:{outcome}")
        if kind in ("stop_ranks", *_RESTARTS, "retry_step"):
            self._stop_training()
        if kind in _RESTARTS:
            self.inflight[command.id] = (command.attempt, frozenset(self._command_ranks(command)))
        if kind in (*_RESTARTS, "retry_step"):
            self.newest_sent = max(self.newest_sent, command.attempt)
        if recorded is not None and recorded.status == DONE:
            # carried out after the recorded time, not the kind's median: the simulated executor's model still runs
            # and may refuse it (its ranks' hardware, the plan's sources are the simulated night's)
            self.sched.at(now + int(recorded.after_s * NS), lambda: self._complete(command, "ok"))
            return
        if recorded is not None:
            self._answer_as_recorded(command, recorded)
            return
        cost = int(self.command_cost_s(command) * NS)
        if self.checks and kind in _RESTARTS:
            # the agents' gate before the ranks start: after the device reset, if any (`recovery.sim.health`)
            gate_at = now + lat + (int(self.cfg.costs.device_reset_s * NS) if self._resets(command) else 0)
            wait, refused_on = self.gate(command, gate_at)
            if refused_on is not None and outcome != "timeout":
                self.sched.at(gate_at + wait, partial(self._refused, command, refused_on))
                return
            cost += wait
        self.sched.at(now + lat + cost, lambda: self._complete(command, outcome))

    @staticmethod
    def _resets(command: Any) -> bool:
        return command.kind == "restart_ranks" and bool(command.reset_devices)

    def _refused(self, command: Any, node: str) -> None:
        """A node failed the checks its gate waited for: its agent starts no rank there, and the command fails."""
        if self.failed:
            return
        self.inflight.pop(command.id, None)
        if command.kind == "restart_job":
            self._place(list(command.nodes))  # the other pods were recreated there, as for an unhealthy node
        self._count(f"{command.kind}:refused")
        self._ack(command, "failed", f"health checks failed on {node}", {"node": node})
        self._maybe_resume()

    def _recorded_answer(self, command: Any) -> RecordedAnswer | None:
        """The recorded night's answer to the command of this one's kind and order, if the recorded engine sent as
        many and the recorded executor answered it (or never did)."""
        key = answer_kind(command.kind, getattr(command, "mode", None), bool(getattr(command, "reset_devices", None)))
        nth = self.issued[key] = self.issued.get(key, 0) + 1
        return self.answers.get((key, nth))

    def _answer_as_recorded(self, command: Any, answer: RecordedAnswer) -> None:
        """Acknowledged and failed when the recorded executor did, with its reason and result (the engine reads a
        reset's failed devices in it); or never answered at all: the attempt's deadline ends it, as recorded."""
        if answer.status != FAILED:
            self.inflight.pop(command.id, None)  # never carried out: its ranks are nobody's to bring back
            return

        def failed() -> None:
            self.inflight.pop(command.id, None)
            if self.failed:
                return
            self._ack(command, "accepted")
            self._ack(command, "failed", answer.reason, dict(answer.result))
            self._maybe_resume()
        self.later(int(answer.after_s * NS), failed)

    def _ack(self, command: CommandBase, status: str, reason: str = "", result: dict[str, Any] | None = None
             ) -> None:
        data: dict[str, Any] = {"command_id": command.id, "status": status, "reason": reason}
        if result:
            data["result"] = result
        self.job_event("command.ack", data, source="executor")

    def _command_ranks(self, command: Any) -> list[int]:
        kind = command.kind
        if kind in ("restart_ranks", "migrate_ranks"):
            return list(command.ranks)
        if kind == "restart_job":
            return list(range(self.world_size))
        if kind == "scale_job":  # the ranks whose processes it keeps are live replicas, not restarted
            kept = set(command.kept)
            return [r for r in range(command.dp * self.tp * self.pp) if r not in kept]
        return []

    def _complete(self, command: Any, outcome: str) -> None:
        kind = command.kind
        self.inflight.pop(command.id, None)
        if self.failed and kind != "fail_job":
            return
        if outcome == "timeout":
            self._maybe_resume()
            return
        if outcome == "failed":
            self._ack(command, "failed", "executor error (simulated)")
            self._maybe_resume()
            return
        why = getattr(self, f"_do_{kind}")(command)
        if why:
            self._count(f"{kind}:refused")
            self._ack(command, "failed", why)
            self._maybe_resume()
            return
        if kind in _RESTARTS:
            self.note_landed(command)
        if kind != "save_checkpoint":
            self._ack(command, "done")
        self._maybe_resume()

    def _others_blocked(self, ranks: set[int], generation: int) -> str:
        """Ranks outside the restart must still run (they roll back in place) unless another restart of the same
        generation is bringing them back."""
        covered = set(ranks)
        for gen, others in self.inflight.values():
            if gen == generation:
                covered |= others
        missing = sorted((self.dead | self.hung) - covered)
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            return f"ranks {missing[:8]}{more} are not running and cannot roll back"
        return ""

    def _plan_missing(self, plan: ResumePlan, restarting: set[int]) -> str:
        """An in-memory snapshot the plan relies on that no host holds any more. Hosts keep their latest snapshot
        only and lose it when they power-cycle; a rank whose named holder lost it reads the same shard of the same
        step from another replica's host if one has it (as Gemini recovers from a peer's memory)."""
        step = plan.checkpoint_step
        if step is not None and any(s.tier is Tier.PEER for s in plan.shards):
            return self._peers_missing(plan, step, restarting)
        memory = [s for s in plan.shards if s.tier is Tier.MEMORY]
        if step is None or not memory:
            return ""
        held = {r % self.shards for r in self.reporters()
                if self.mem_step.get(self.node_of(r)) == step and not self.hw[self.node_of(r)].down}
        for source in memory:
            if source.shard not in held:
                return f"no host holds shard {source.shard} of step {step} in memory any more"
            if not any(self.mem_step.get(h) == step and not self.hw[h].down for h in source.holders):
                self._count("memory_read_from_peer")
        return ""

    def _restarting(self, command: Any) -> set[int]:
        """The command's ranks and those other restarts of its attempt brought back already."""
        earlier = self.restarted if command.attempt == self.generation else set()
        return set(self._command_ranks(command)) | earlier

    def _peers_missing(self, plan: ResumePlan, step: int, restarting: set[int]) -> str:
        """A live replica to send each shard: its process running and not restarted itself, on a healthy node, at
        the plan's step (the job halted there: a peer cannot send a step it is not at)."""
        if step != self.halted_step:
            return f"the live replicas are at step {self.halted_step}, not {step}"
        gone = self.dead | self.hung | restarting
        for source in plan.shards:
            if source.tier is not Tier.PEER:
                continue
            if not any(r not in gone and self.hw[self.node_of(r)].healthy
                       for r in range(source.shard, self.world_size, self.shards)
                       if self.node_of(r) in source.holders):
                return f"no live replica of shard {source.shard} on {source.holders} to send it"
        self._count("state_from_peers")
        return ""

    def _restarted(self, command: Any, ranks: list[int]) -> None:
        if command.attempt != self.generation:
            self.generation = command.attempt
            self.restarted = set()
        self.restarted.update(ranks)
        self.dead.difference_update(ranks)
        self.hung.difference_update(ranks)
        self.plan = command.plan
        self.retried = False
        self._epoch += 1

    def _do_stop_ranks(self, command: Any) -> str:
        self.dead.update(command.ranks)
        self.hung.difference_update(command.ranks)
        return ""

    def _do_save_checkpoint(self, command: Any) -> str:
        # As an agent does: the ranks that have ended since the command was sent (stopped with the job) are passed
        # over, the running ones save; it fails when none can.
        running = [rank for rank in command.ranks if rank < self.world_size and rank not in self.dead]
        if not running:
            return f"rank(s) {command.ranks} are not running: none can save"
        for rank in running:
            if rank in self.hung:
                return f"rank {rank} is not running: it cannot save"
            hw = self.hw[self.node_of(rank)]
            device = rank % self.rpn
            if hw.down or hw.gpu_lost == device or device in hw.bad:
                return f"rank {rank}'s {'node' if hw.down else 'device'} on {hw.name} is gone"
        shards = sorted({r % self.shards for r in running})
        self.job_event("checkpoint.saved", {"step": command.step, "tier": Tier.DYING, "holder": STORAGE_HOLDER,
                                            "shards": shards}, source="executor")
        self._ack(command, "done")
        return ""

    def _do_retry_step(self, command: Any) -> str:
        why = self._unhealthy(self.placement) or self._others_blocked(set(), self.generation)
        if why:
            return f"the step failed again: {why}"
        if command.attempt != self.generation:  # a retry is a new generation of the same processes
            self.generation = command.attempt
            self.restarted = set()
        self.retried = True
        self._epoch += 1
        return ""

    def _do_restart_ranks(self, command: Any) -> str:
        for name, devices in command.reset_devices.items():
            if name in self.hw:  # a reset clears what needs one (an XID 48); a lemon may fault again
                self.hw[name].bad.difference_update(devices)
        nodes = sorted({self.node_of(r) for r in command.ranks})
        if command.attempt < self.newest_sent:
            return self._unhealthy(nodes) or self._superseded_restart(command)
        why = (self._unhealthy(nodes) or self._others_blocked(set(command.ranks), command.attempt)
               or self._plan_missing(command.plan, self._restarting(command)))
        if why:
            return why
        self._restarted(command, list(command.ranks))
        return ""

    def _superseded_restart(self, command: Any) -> str:
        """An in-place restart of an attempt a newer one superseded, carried out as a real executor does: its ranks'
        processes start whatever the other ranks do, and abandon their generation for the newest (the SDK's), whose
        own restart brings the others back. They join it like survivors, as the engine expects of the ranks that
        attempt carried over: the newest generation, its plan and its restarts stay as they are."""
        self.dead.difference_update(command.ranks)
        self.hung.difference_update(command.ranks)
        return ""

    def _do_migrate_ranks(self, command: Any) -> str:
        if command.from_node not in self.placement:
            return f"{command.from_node} is not in the job"
        why = (self._unhealthy([command.to_node]) or self._others_blocked(set(command.ranks), command.attempt)
               or self._plan_missing(command.plan, self._restarting(command)))
        if why:
            return why
        self._place([command.to_node if n == command.from_node else n for n in self.placement])
        self._restarted(command, list(command.ranks))
        return ""

    def _do_restart_job(self, command: Any) -> str:
        why = self._unhealthy(list(command.nodes))
        if why:
            # A job-level reschedule recreates every pod on the nodes it names, also when one of them fails to
            # start: the job has left its old nodes either way, as the engine (which placed it there) expects.
            # Keeping the old placement made the two disagree: the nodes the engine released came back, repaired,
            # as the job's own (`spare: false`) and were lost to the pool.
            self._place(list(command.nodes))
            return why
        # The resume plan's sources are checked before the job is torn down (where its ranks run now): a plan no
        # host can serve fails the command with the job where it was.
        why = self._plan_missing(command.plan, self._restarting(command))
        if why:
            return why
        self._place(list(command.nodes))
        self.dead.clear()
        self.hung.clear()
        self._restarted(command, list(range(self.world_size)))
        return ""

    def _place(self, nodes: list[str]) -> None:
        """The job now runs on `nodes`. A node it left that is healthy goes back to the spare pool once the
        scheduler has cleaned it up; a broken one when its repair is done."""
        keep = set(nodes)
        left = [n for n in self.placement if n not in keep]
        self.placement = nodes
        for name in left:
            hw = self.hw[name]
            if not hw.repairing:
                hw.repairing = True
                self.later(int(self.cfg.durations.node_return_s * NS), partial(self._repaired, name))

    def _do_scale_job(self, command: Any) -> str:
        why = self._unhealthy(list(command.nodes)) or self._plan_missing(command.plan, self._restarting(command))
        if why:
            return why
        self._place(list(command.nodes))
        self.dp = command.dp
        self.dead.clear()
        self.hung.clear()
        self._restarted(command, list(range(self.world_size)))
        return ""

    def _do_isolate_node(self, command: Any) -> str:
        hw = self.hw[command.node]
        hw.isolated = True
        self.replaced.update((command.node, device) for device in range(self.rpn))
        self._repair_later(command.node, int(self.cfg.durations.node_repair_mean_s * NS))
        return ""

    def _do_isolate_device(self, command: Any) -> str:
        hw = self.hw[command.node]
        hw.bad.add(command.device)
        self.replaced.add((command.node, command.device))
        self._repair_later(command.node, int(self.cfg.durations.device_repair_mean_s * NS))
        return ""

    def _do_fail_job(self, command: Any) -> str:
        self._stop_training()
        self.failed = True
        return ""

