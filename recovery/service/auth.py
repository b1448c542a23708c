"""NATS users with subject permissions, one per role: what each part of the control plane may publish and read.

    python -m recovery.service.auth --nodes n0,n1,n2 --out auth.conf --urls urls.json [--host nats.example:4222]

writes the `authorization` block a `nats-server` configuration includes (`include auth.conf`), with a random
password per user, and the URL each role connects with (`nats://user:password@host`). The roles:

- `daemon`: everything (it alone writes decisions, dead letters, timer firings and commands, and answers
  `recovery-ctl`).
- `agent-<node>`, one per node: publishes its node's events (`recovery.ev.node.<node>.>`, but the liveness monitor's
  `node.silent`, `node.heard` and `node.unreachable`), its live beats (`recovery.live.<node>`), its ranks' word that a
  peer's connection closed (`recovery.suspect.<node>`), and answers the daemon's probe (`recovery.probe.<node>`, a
  reply only: `allow_responses`); it publishes job events (the ranks it
  runs report through it, for jobs it does not know in advance) except timer firings and `policy.overran` facts,
  which only the daemon sends (the engine also refuses a firing not sealed by it: `recovery.core.firings`); reads the
  log's job submissions and its own node's commands (`recovery.cmd.<node>.>`, through a JetStream consumer filtered
  on them, the only one it may create on the command stream); receives replies only on its own inbox prefix
  (`_INBOX_<node>`: the agent's `nats_inbox_prefix`), so that it cannot watch another node's deliveries.
- `operator`: `recovery-ctl` (its requests to the daemon, which publishes what they ask for) and every read of the
  log (`recovery-replay --nats`).
- `auditor`: reads the log and the command stream; publishes nothing the control plane takes as input.

The engine also checks that a node event's node matches the subject it came on (`subject_mismatch`), so a node's
events cannot be forged under another's name even by a client this file does not confine.

For fleets of thousands of nodes, the same permissions map to NATS decentralized auth (JWT users signed per node by
an account key), where a user's permissions are written once with `{{name()}}` templates instead of one block per
node; this module writes the static form, which `nats-server --reload` picks up when nodes are added.

Both files hold every password in plain text and are written readable by their owner alone (0600). NATS's nkeys
would leave only public keys in the server's file, but nats-py needs the `nkeys` package (and PyNaCl) to sign with
them, which this project does not depend on, and every client here is configured by one URL; the static form with
passwords stays until the platform asks for nkeys or JWTs. A client whose user may not do something it asks is told
so in its log (`recovery.log.refusals`), not only by a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from events import subjects

LOG_STREAM = "RECOVERY"
COMMAND_STREAM = "RECOVERY_CMD"
API = "$JS.API"


@dataclass(frozen=True)
class User:
    """One NATS user: its name, password, and the subjects it may publish to and subscribe to."""

    name: str
    password: str
    publish: list[str]
    subscribe: list[str]
    inbox_prefix: str = "_INBOX"
    notes: list[str] = field(default_factory=list)
    publish_deny: list[str] = field(default_factory=list)
    """subjects refused although `publish` allows them"""
    responds: bool = False
    """may answer a request it received (NATS's `allow_responses`: one reply, to the subject the request named)"""

    def block(self) -> str:
        def quoted(items: list[str]) -> str:
            return ", ".join(json.dumps(item) for item in items)

        deny = f", deny: [{quoted(self.publish_deny)}]" if self.publish_deny else ""
        responds = "      allow_responses: true\n" if self.responds else ""
        return (f"    {{user: {json.dumps(self.name)}, password: {json.dumps(self.password)}, permissions: {{\n"
                f"      publish: {{allow: [{quoted(self.publish)}]{deny}}}\n"
                f"      subscribe: {{allow: [{quoted(self.subscribe)}]}}\n"
                f"{responds}"
                f"    }}}}")


def _readers(stream: str) -> list[str]:
    """What reading `stream` through the project's pull reader asks of the JetStream API."""
    return [f"{API}.STREAM.INFO.{stream}", f"{API}.CONSUMER.CREATE.{stream}.>", f"{API}.CONSUMER.MSG.NEXT.{stream}.*",
            f"{API}.CONSUMER.DELETE.{stream}.*", f"{API}.CONSUMER.INFO.{stream}.*"]


def agent_inbox(node: str) -> str:
    return f"_INBOX_{node}"


def daemon_user(password: str) -> User:
    return User("daemon", password, [">"], [">"])


def agent_user(node: str, password: str, log_stream: str = LOG_STREAM, command_stream: str = COMMAND_STREAM) -> User:
    subjects.check_token(node)
    own_commands = subjects.node_commands(node)
    publish = [
        f"{subjects.PREFIX}.ev.node.{node}.>",
        subjects.live(node),  # its live beats (`liveness = "live"`), on core NATS: no stream keeps them
        subjects.reports(node),  # its periodic reports (`progress = "summary"`), on core NATS too
        f"{subjects.PREFIX}.ev.job.>",
        f"{API}.INFO",
        f"{API}.STREAM.INFO.{log_stream}",
        f"{API}.STREAM.INFO.{command_stream}",
        # The log: job submissions (a consumer filtered on them) and whatever else it reads back.
        f"{API}.CONSUMER.CREATE.{log_stream}.>",
        f"{API}.CONSUMER.MSG.NEXT.{log_stream}.*",
        f"{API}.CONSUMER.DELETE.{log_stream}.*",
        # The command stream: a consumer may be created only filtered on this node's commands (the filter is
        # part of the API subject when a consumer is created by name, as the pull reader does).
        f"{API}.CONSUMER.CREATE.{command_stream}.*.{own_commands}",
        f"{API}.CONSUMER.MSG.NEXT.{command_stream}.*",
        f"{API}.CONSUMER.DELETE.{command_stream}.*",
    ]
    # Job events are open to the agent (its ranks' jobs are not known in advance), except timer firings, outage
    # records, the facts of abandoned policy calls and progress summaries: only the daemon sends those, and a forged
    # one must not even reach the log.
    deny = [subjects.job_event("*", kind) for kind in ("timer.fired", "control.outage", "policy.overran",
                                                       "progress.summary")]
    # Nor the liveness monitor's word on a node (`recovery.service.liveness`): an agent would declare itself silent.
    deny += [subjects.node_event(node, kind) for kind in ("node.silent", "node.heard", "node.unreachable")]
    # The daemon's probe of this node, answered on the asker's inbox (`allow_responses`: a reply only, once).
    return User(f"agent-{node}", password, [*publish, subjects.suspect(node)],
                [f"{agent_inbox(node)}.>", subjects.probe(node)], inbox_prefix=agent_inbox(node), publish_deny=deny,
                responds=True)


def operator_user(password: str) -> User:
    # The default inbox: no agent receives on it (each has its own prefix), and what the daemon receives there is
    # the log, which an operator reads anyway.
    publish = [f"{subjects.PREFIX}.ctl.>", f"{API}.INFO", *_readers(LOG_STREAM), *_readers(COMMAND_STREAM)]
    return User("operator", password, publish, ["_INBOX.>"])


def auditor_user(password: str) -> User:
    return User("auditor", password, [f"{API}.INFO", *_readers(LOG_STREAM), *_readers(COMMAND_STREAM)],
                ["_INBOX.>"])


def users(nodes: Sequence[str], password: str | None = None) -> list[User]:
    """Every role's user; a random password each unless `password` is given (tests)."""
    def pw() -> str:
        return password or secrets.token_urlsafe(24)

    return [daemon_user(pw()), operator_user(pw()), auditor_user(pw()), *(agent_user(n, pw()) for n in nodes)]


def authorization(all_users: Sequence[User]) -> str:
    """The `authorization { users = [...] }` block of a nats-server configuration."""
    return "authorization {\n  users = [\n" + "\n".join(u.block() for u in all_users) + "\n  ]\n}\n"


def urls(all_users: Sequence[User], host: str) -> dict[str, dict[str, str]]:
    """Per user, the URL to connect with and the inbox prefix to use (`nats_inbox_prefix` of the agent)."""
    return {u.name: {"url": f"nats://{u.name}:{u.password}@{host}", "inbox_prefix": u.inbox_prefix}
            for u in all_users}


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner alone (0600), from the first byte: a file written with the
    default mode and narrowed after lies readable by everyone in between, and keeps a wider mode it had before."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(fd, 0o600)
        out.write(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recovery.service.auth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", required=True, help="comma-separated node names (one agent user each)")
    parser.add_argument("--out", required=True, help="where to write the authorization block")
    parser.add_argument("--urls", required=True, help="where to write each user's URL and inbox prefix (JSON)")
    parser.add_argument("--host", default="127.0.0.1:4222", help="host:port the URLs name")
    args = parser.parse_args(argv)
    try:
        made = users([n.strip() for n in args.nodes.split(",") if n.strip()])
    except ValueError as exc:
        print(f"python -m recovery.service.auth: {exc}", file=sys.stderr)
        return 2
    write_private(Path(args.out), authorization(made))  # both files hold every password, in plain text
    write_private(Path(args.urls), json.dumps(urls(made, args.host), indent=2) + "\n")
    print(f"{len(made)} users written to {args.out}; their URLs to {args.urls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
