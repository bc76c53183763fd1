//! Broker stopped and restarted mid-run.
