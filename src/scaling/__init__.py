"""Predicted scaling of data-parallel training: the cost model (`costmodel`), the gloo probe (`probe`) and the
tables, plots and command line of `python -m src.scaling` (`predict`).

Empty on purpose: every probe process imports this package again, and should find only torch to load.
"""
