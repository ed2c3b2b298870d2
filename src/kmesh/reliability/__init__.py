"""Reliability machinery (issue 26): soak under memory pressure; the reliability stage runs it."""
