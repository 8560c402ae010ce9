"""A Python client for teams that run rollouts themselves, in the style of OpenPipe ART.

    from gateway.client import Model, gather

    model = Model("support-bot", "http://127.0.0.1:8000", api_key="sk-app", admin_key="sk-admin")
    groups = await gather(model, rollout, scenarios, attempts=4)   # rollout(trajectory, scenario) -> reward
    await model.send_rewards(groups)
    run = await model.train(overrides={"grouping": "key"})
    if run.promoted:
        await model.wait_for_version(run.to_version)

It talks to the gateway over HTTP only (so it works against a remote one unchanged) and imports neither torch,
polars nor the server side; `openai` is imported when a client is asked for. See docs/client.md.
"""

from gateway.client.agent import AgentOutcome, PolicyTools, run_agent
from gateway.client.connection import Connection, KaizenError
from gateway.client.model import Model, Run
from gateway.client.rollouts import Rollout, RolloutsFailed, gather
from gateway.client.trajectories import Trajectory, TrajectoryGroup

__all__ = [
    "AgentOutcome",
    "Connection",
    "KaizenError",
    "Model",
    "PolicyTools",
    "Rollout",
    "RolloutsFailed",
    "Run",
    "Trajectory",
    "TrajectoryGroup",
    "gather",
    "run_agent",
]
