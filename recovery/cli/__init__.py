"""The console scripts: `recovery-daemon` (`daemon`), `recovery-replay` (`replay`) and `recovery-ctl` (`ctl`)."""
