"""The learner: turns captured, rewarded trajectories into a new LoRA adapter version with torch.

Only a training process imports it (`python -m trainer.learner`, started by the scheduler or `kaizen train`);
the gateway starts that process and reads its outcome from the database. The gateway's model jobs (version 0 of
a policy, the embedded model's conversion) run its modules the same way, as child processes
(`trainer.control.model_jobs`).
"""
