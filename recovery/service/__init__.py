"""The service: `recovery-daemon` (`daemon`, the wiring of its parts) on NATS JetStream, configured by `config`: its
streams (`streams`), input consumer (`consumer`), processor (`processor`), publisher (`publisher`), snapshots
(`snapshots`) and the restore from them (`restore`), timer service (`timers`), control service for `recovery-ctl`
(`control`), metrics and health endpoints (`http`), the partition lease (`lease`), several active daemons sharing
the partitions (`ownership`) and the fence on a partition's outputs (`fence`), the embedded nats-server
(`embedded`), structured JSON logging (`jsonlog`), hot-path tuning (`speedups`) and the demo (`demo`)."""
