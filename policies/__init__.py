"""Policy contract and built-in policies (loaded through the `recovery.policies` entry points)."""
