"""Tables and plots rendered from result files (never from anything else)."""
