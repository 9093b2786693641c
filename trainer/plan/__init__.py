"""Planning without training: per-device memory, communication and step time, the layout search, the cluster simulator, and the one hardware table."""
