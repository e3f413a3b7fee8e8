"""KV events: what each tier holds, announced as it changes (WatchEvents, Snapshot, a vLLM-format publisher)."""
