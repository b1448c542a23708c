"""What users and plugin authors test with: the time-skipping `Scenario` harness (`scenario`), a real
`nats-server -js` on free ports (`nats`), and the contract suite every event log passes (`log_contract`, which
needs pytest: import it from there)."""

from recovery.testing.nats import NatsServer, free_port
from recovery.testing.scenario import Scenario

__all__ = ["NatsServer", "Scenario", "free_port"]
