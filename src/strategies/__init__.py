"""Strategies: how gradients travel between processes."""

from src.strategies import dp as _dp  # noqa: F401  registers strategy="dp" with Lightning's StrategyRegistry
