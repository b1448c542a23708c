"""The service: `recovery-daemon` (`daemon`) on NATS JetStream, configured by `config`, with its control service for
`recovery-ctl` (`control`), metrics and health endpoints (`http`), the partition lease (`lease`), the embedded
nats-server (`embedded`), structured JSON logging (`jsonlog`), hot-path tuning (`speedups`) and the demo (`demo`)."""
