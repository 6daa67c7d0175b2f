"""Watching the broker: the audit log and Prometheus metrics."""
