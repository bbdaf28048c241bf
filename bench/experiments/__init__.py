"""Experiments: measurements behind a design decision, not a goal's current figure."""
