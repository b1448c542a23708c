"""The pure engine: `Engine.apply(record) -> effects`, the cluster view, the job and its incidents, the job's state
machine, and how effects are written back into a log. No I/O, no clock, no network: everything it knows comes in
as a record."""
