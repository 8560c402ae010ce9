"""Test helpers: real servers that integration tests and benchmarks talk to."""
