"""Kaizen trainer: turns captured, rewarded trajectories into new LoRA adapter versions."""
