"""What users and plugin authors test with: the time-skipping `Scenario` harness (`scenario`), a real
`nats-server -js` on free ports (`nats`), the contract suite every event log passes (`log_contract`, which
needs pytest: import it from there), and the policy kit: the contract test cases every policy passes
(`policy_contract`: `DetectionPolicyContract`, `ReschedulingPolicyContract`, `CheckpointPolicyContract`) with the
factories and hypothesis strategies of policy contexts (`policy_contexts`: `make_signal`, `signals`, ...).

The policy kit needs pytest and hypothesis (`pip install 'recovery[testing]'`): its names are exported from here
but loaded when first used, so `Scenario` and `NatsServer` need neither.
"""

from typing import Any

from recovery.testing.nats import NatsServer, free_port
from recovery.testing.scenario import Scenario

_CONTRACT = frozenset({"CONTRACTS", "Call", "CheckpointPolicyContract", "DetectionPolicyContract", "ImpureCall",
                       "PolicyContract", "ReschedulingPolicyContract", "canonical", "forbid_clock_and_io"})
_CONTEXTS = frozenset({"checkpoint_contexts", "make_checkpoint_context", "make_reschedule_context", "make_signal",
                       "make_watchdog_view", "reschedule_contexts", "signals", "watchdog_views"})


def __getattr__(name: str) -> Any:
    # Loaded on first use rather than at import: the policy kit's pytest and hypothesis are test dependencies.
    if name in _CONTRACT:
        from recovery.testing import policy_contract
        return getattr(policy_contract, name)
    if name in _CONTEXTS:
        from recovery.testing import policy_contexts
        return getattr(policy_contexts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONTRACTS", "Call", "CheckpointPolicyContract", "DetectionPolicyContract", "ImpureCall", "NatsServer",
           "PolicyContract", "ReschedulingPolicyContract", "Scenario", "canonical", "checkpoint_contexts",
           "forbid_clock_and_io", "free_port", "make_checkpoint_context", "make_reschedule_context", "make_signal",
           "make_watchdog_view", "reschedule_contexts", "signals", "watchdog_views"]
