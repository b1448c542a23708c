"""`recovery-agent`: one per node. It launches the ranks placed on its node for jobs submitted with an entrypoint
(with torchrun's environment), hosts a job's rendezvous store in a small process of its own, relays what its
processes report through the SDK (`recovery.client`), publishes what it sees of them (started, exited, from the
wait status), and carries out the commands addressed to its node, acknowledging each.

- `config.py`: the settings (TOML, environment, flags), as the daemon's.
- `outbox.py`: events in order to JetStream, buffered while NATS is away.
- `channel.py`: the local Unix socket the SDK talks to.
- `ranks.py`: the rank processes: environment, start, signals, wait status.
- `rendezvous.py`: the rendezvous store process.
- `standby.py`: warm standbys, pre-started interpreters a restarted rank is handed to (opt-in); `interpreter.py` is
  what such an interpreter runs.
- `agent.py`: the agent itself: jobs, commands, acks.
- `probes/`: the node's hardware facts: NVIDIA XIDs from the kernel log, links' operstate.
- `checks/`: the node's health checks before ranks land on it, logged as `node.checked`.
"""
