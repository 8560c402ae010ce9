"""The trainer's control plane: what decides when and how a policy learns, without torch, transformers, peft or
polars, so that the serving process may import it."""
