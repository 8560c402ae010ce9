"""The learner: turns captured, rewarded trajectories into a new LoRA adapter version with torch.

Only a training process imports it (`python -m trainer.learner`, started by the scheduler or `kaizen train`);
the gateway starts that process and reads its outcome from the database.
"""
