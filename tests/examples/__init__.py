"""The examples of docs/extending.md: a network, a DDP communication hook, a strategy and a data module
that the framework picks up by config alone (tests/test_extending.py runs each of them)."""
