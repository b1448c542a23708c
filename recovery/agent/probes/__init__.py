"""The node agent's hardware probes: what the node's kernel and sysfs say, turned into node events.

- `xid`: NVIDIA XIDs from the kernel log (`/dev/kmsg`, or a file), as `device.fault` events.
- `links`: the operational state of configured network interfaces, as `network.link_down` and
  `network.link_up` events.

Every fact a probe reports has `type`, a key of `events.kinds.NODE_EVENTS`, and `event`, the validated model of
that type, ready for `events.make_envelope(fact.type, fact.event, id=..., node=...)`. Probes are plain
synchronous code with no clock of their own beyond the waits the caller asks for: the agent decides how often to
poll and on which thread.
"""
