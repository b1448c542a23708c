"""The service: `recovery-daemon` (`daemon`, the wiring of its parts) on NATS JetStream, configured by `config`: its
input consumer (`consumer`), processor (`processor`), publisher (`publisher`), snapshots (`snapshots`), timer
service (`timers`), control service for `recovery-ctl` (`control`), metrics and health endpoints (`http`), the
partition lease (`lease`), the embedded nats-server (`embedded`), structured JSON logging (`jsonlog`), hot-path
tuning (`speedups`) and the demo (`demo`)."""
