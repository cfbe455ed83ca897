"""Predicted scaling of data-parallel training (docs/scaling.md). Empty on purpose: every probe process
imports this package again, and should find only torch to load."""
