"""Examples that plug podsjax into other libraries; run from the root of a clone."""
