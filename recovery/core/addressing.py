"""Which nodes' agents a command concerns, from the command and the job's placement when it was decided."""

from __future__ import annotations

from collections.abc import Callable

from events.commands import (
    Command,
    DumpStacks,
    FailJob,
    IsolateDevice,
    IsolateNode,
    MigrateRanks,
    RestartJob,
    RestartRanks,
    RetryStep,
    SaveCheckpoint,
    ScaleJob,
    StopRanks,
)


def command_nodes(command: Command, node_of: Callable[[int], str], job_nodes: list[str]) -> list[str]:
    """The nodes whose agents carry out `command`, in first-concerned order without repeats.

    `node_of` maps a rank to its node and `job_nodes` is the job's placement, both as the engine holds them
    after the record that decided the command: ranks named by a stop, save or in-place restart run there; a
    migration concerns the node left (whose agent stops what is left of the ranks) and the node joined; a
    job-wide command concerns every node of the job."""
    nodes: list[str]
    match command:
        case StopRanks() | SaveCheckpoint() | RestartRanks():
            nodes = [node_of(rank) for rank in command.ranks]
        case MigrateRanks():
            nodes = [command.from_node, command.to_node]
        case RestartJob() | ScaleJob():
            nodes = [*command.nodes, *job_nodes]
        case IsolateNode() | IsolateDevice():
            nodes = [command.node]
        case RetryStep() | FailJob() | DumpStacks():
            nodes = list(job_nodes)
    return list(dict.fromkeys(nodes))
