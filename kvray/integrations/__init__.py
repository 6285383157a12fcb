"""Engine connectors: each moves an inference engine's own KV cache with kvray, behind an optional extra."""
