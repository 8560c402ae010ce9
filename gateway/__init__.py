"""The Kaizen gateway: OpenAI-compatible HTTP surface, capture, engines and the `kaizen` CLI."""
