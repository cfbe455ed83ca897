"""Callbacks that measure runs: epoch time and throughput, communication."""
