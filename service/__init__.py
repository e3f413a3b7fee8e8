"""The kvxfer daemon: a thin gRPC adapter over the kvxfer library."""
