"""Engines: what actually generates tokens. One interface (`base.Engine`); `upstream` and `vllm` implement it."""
