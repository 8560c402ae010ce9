"""Runs the demo: a real gateway (`kaizen serve`, vLLM on this machine) in a child process, a policy whose
schedule trains on a threshold of new rewarded episodes, and the simulated app's traffic in cycles until the
time is up. Everything goes through HTTP, as it would for a user."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway.base_models import resolve_base_model
from gateway.commands.serve_process import GatewayProcess
from gateway.demo.agent_tasks import AGENT_TASKS, AgentTask
from gateway.demo.report import Cycle, summarise, write_chart, write_json
from gateway.demo.tasks import TASKS, Task
from gateway.demo.traffic import AgentApp, SimulatedApp

logger = logging.getLogger(__name__)

POLICY = "demo"


@dataclass(frozen=True)
class DemoOptions:
    out: Path | None  # demo.json, demo.png and gateway.log go here
    data_dir: Path  # the demo gateway's own data (database, adapters); not the user's
    models_dir: Path  # where the base model is (pulled once, shared with the user's gateway)
    base_model: str
    minutes: float = 20.0
    cycle_calls: int = 60  # the task has 60 questions: every cycle asks each exactly once
    rate: float = 0.5  # calls per second: steady user traffic that leaves CPU for training
    concurrency: int = 8
    max_tokens: int = 16
    seed: int = 0
    learning_rate: float = 3e-4
    task: str = "opposites"  # a name in gateway.demo.tasks.TASKS or gateway.demo.agent_tasks.AGENT_TASKS
    stop_at_target: bool = False  # end early once a trained version's cycle reaches the task's target reward

    @property
    def the_task(self) -> Task | AgentTask:
        return AGENT_TASKS[self.task] if self.task in AGENT_TASKS else TASKS[self.task]

    @property
    def reply_tokens(self) -> int:
        """Tokens per reply: an agent's turn may be a tool call, longer than the one-word answers."""
        task = self.the_task
        return max(self.max_tokens, task.max_tokens) if isinstance(task, AgentTask) else self.max_tokens


#: New rewarded episodes that start a training run.
TRAIN_AFTER_EPISODES = 16


def policy_config(options: DemoOptions) -> dict[str, Any]:
    """The demo policy: production-style `resample` groups over every episode rewarded since the last run,
    trained as soon as a handful arrive, scored by the task's reward function where nobody gave feedback, and
    guarded by the evaluation gate on held-out questions. An agent task's tool is the policy's own, so
    resampling and the gate re-run whole episodes with it."""
    task = options.the_task
    config = _policy_config(options)
    if isinstance(task, AgentTask):
        config["rewards"]["scorer"]["function"] = "gateway.demo.agent_tasks:score"
        config["tools"] = {"functions": [task.tool_path]}
        config["train"]["max_turns"] = task.max_turns
        # An episode costs the engine two or three calls, each reading the tool's schema, and resampling shares
        # the engine with live traffic: one round (each new task topped up to `group_size`) and a gate of 8
        # contexts x 4 episodes keep a run to minutes on a small machine. Measured in docs/performance.md.
        config["train"]["resample_budget"] = (config["train"]["group_size"] - 1) * TRAIN_AFTER_EPISODES
        config["gate"]["samples"] = 4
    return config


def _policy_config(options: DemoOptions) -> dict[str, Any]:
    tokens = options.reply_tokens
    return {
        "train": {
            "grouping": "resample",
            "group_size": 8,
            "max_new_tokens": tokens,
            "learning_rate": options.learning_rate,
            "micro_batch_size": 8,
            "grad_accumulation": 4,
            "collapse_check_every": 0,
            "collapse_prompts": 4,
            "collapse_samples": 4,
            "collapse_max_new_tokens": tokens,
            "seed": options.seed,
        },
        "rewards": {"scorer": {"function": "gateway.demo.tasks:score"}},
        "schedule": {
            "judge_interval_s": None,
            "train_cron": None,
            "train_min_new_episodes": TRAIN_AFTER_EPISODES,
            "threshold_check_s": 2,
            "retention": {"cron": None},
        },
        "gate": {
            "holdout_fraction": 0.1,
            "max_groups": 8,
            "samples": 8,  # 8 contexts x 8 replies per version: the means are precise to about ±0.07
            "max_tokens": tokens,
            "tolerance": 0.05,
        },
    }


def split_cores(env: dict[str, str], cpus: int) -> None:
    """Give vLLM the first half of the cores and training the rest, unless the user chose already: on a small
    machine, OpenMP threads of both competing for every core slow each of them down far more than halving."""
    if cpus < 2:
        return
    serving = cpus // 2
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if serving == 1 else f"0-{serving - 1}")
    env.setdefault("OMP_NUM_THREADS", str(cpus - serving))


def _promotion_regressions(cycles: list[Cycle], window: int = 2) -> list[float]:
    """For each change of serving version: mean reward of up to `window` cycles before it minus after it."""
    drops = []
    for i in range(1, len(cycles)):
        if cycles[i].version != cycles[i - 1].version:
            before = [c.mean_reward for c in cycles[max(0, i - window) : i]]
            after = [c.mean_reward for c in cycles[i : i + window]]
            drops.append(round(sum(before) / len(before) - sum(after) / len(after), 4))
    return drops


def target_met(cycle: Cycle, task: Task | AgentTask) -> bool:
    """A cycle answered by a trained version (not the base, version 0) at or above the task's target reward:
    what `stop_at_target` waits for, so a run on borrowed hardware ends once it has shown the loop working."""
    return cycle.version not in (0, None) and cycle.mean_reward >= task.target_reward


def summarise_run(
    cycles: list[Cycle],
    options: DemoOptions,
    runs: Sequence[dict[str, Any]] = (),
    policy: dict[str, Any] | None = None,
    stopped_by: str | None = None,
) -> dict[str, Any]:
    """The numbers docs/training.md quotes, whether each target was met, and every finished training run
    (`run_record`); `policy` is the configuration the run used when it was not the demo's own, `stopped_by` the
    signal that ended the run early."""
    task = options.the_task
    base = [c for c in cycles if c.version == 0] or cycles[:1]
    base_reward = sum(c.mean_reward for c in base) / len(base) if base else 0.0
    base_distinct = sum(c.distinct_share for c in base) / len(base) if base else 0.0
    reached = next((c for c in cycles if c.mean_reward >= task.target_reward), None)
    regressions = _promotion_regressions(cycles)
    after_base = [c for c in cycles if c.version not in (0, None)]
    last = cycles[-3:]
    return {
        "task": task.name,
        "minutes": options.minutes,
        "stop_at_target": options.stop_at_target,
        "stopped_by": stopped_by,
        "cycles": len(cycles),
        "calls": sum(c.n_calls for c in cycles),
        "base_reward": round(base_reward, 4),
        "final_reward": round(sum(c.mean_reward for c in last) / len(last), 4) if last else None,
        "best_reward": max((c.mean_reward for c in cycles), default=None),
        "reached_target_at_s": reached.elapsed_s if reached else None,
        "versions_served": sorted({c.version for c in cycles if c.version is not None}),
        "promotion_regressions": regressions,
        "base_distinct_share": round(base_distinct, 4),
        "min_distinct_share_after_base": min((c.distinct_share for c in after_base), default=None),
        "max_empty_share": max((c.empty_share for c in cycles), default=None),
        # Agent tasks: how the episodes got to their answers, first and last cycles.
        "agent_shares": _agent_shares(cycles),
        "targets": {
            f"reward_{task.target_reward}_within_{task.target_minutes:g}_min": reached is not None
            and reached.elapsed_s <= task.target_minutes * 60,
            "no_regression_over_0.05_at_promotion": all(d <= 0.05 for d in regressions),
            "distinct_share_at_least_half_base": all(
                c.distinct_share >= 0.5 * base_distinct for c in after_base
            ),
            "empty_share_under_1pct": all(c.empty_share < 0.01 for c in cycles),
        },
        "settings": {
            "cycle_calls": options.cycle_calls,
            "rate": options.rate,
            "concurrency": options.concurrency,
            "max_tokens": options.max_tokens,
            "seed": options.seed,
            "policy_config": policy if policy is not None else policy_config(options),
        },
        "runs": list(runs),
    }


def _agent_shares(cycles: list[Cycle]) -> dict[str, Any] | None:
    if not cycles or cycles[0].tool_call_share is None:
        return None
    names = ("tool_call_share", "right_call_share", "answered_from_result_share")
    last = cycles[-3:]
    return {
        "first_cycle": {name: getattr(cycles[0], name) for name in names},
        "last_cycles": {
            name: round(sum(getattr(c, name) or 0 for c in last) / len(last), 4) for name in names
        },
    }


async def wait_for_model(url: str, api_key: str, model: str, timeout_s: float = 60) -> None:
    """A new policy is served once the gateway's next policy refresh has seen it."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10, headers={"Authorization": f"Bearer {api_key}"}) as client:
        while time.monotonic() < deadline:
            listed = await client.get(f"{url}/v1/models")
            if listed.status_code == 200 and model in {m["id"] for m in listed.json()["data"]}:
                return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{model!r} never appeared in /v1/models")


async def _new_runs(http: httpx.AsyncClient, url: str, seen: set[int]) -> list[dict[str, Any]]:
    response = await http.get(f"{url}/admin/runs", params={"policy": POLICY, "kind": "train"})
    if response.status_code != 200:
        return []
    # A succeeded run that wrote a candidate is reported once the gate has decided on it.
    finished = [
        r
        for r in response.json()
        if r["finished_at"]
        and r["id"] not in seen
        and (r["status"] != "succeeded" or r["to_version"] is None or "gate" in r["metrics"])
    ]
    seen.update(r["id"] for r in finished)
    return sorted(finished, key=lambda r: r["id"])


def run_record(run: dict[str, Any]) -> dict[str, Any]:
    """What the summary keeps of a training run: outcome, why, how far it moved and what its data cost."""
    metrics = run.get("metrics") or {}
    gate = metrics.get("gate") or {}
    return {
        "id": run["id"],
        "status": run["status"],
        "from_version": run.get("from_version"),
        "to_version": run.get("to_version"),
        "error": (run.get("error") or "")[:400] or None,
        "groups": metrics.get("groups"),
        "samples": metrics.get("samples"),
        "resample": metrics.get("resample"),
        "kl_to_base": metrics.get("kl_to_base"),
        "kl_to_start": metrics.get("kl_to_start"),
        # The collapse checks before the update and at the end: what the guard judged.
        "collapse": [checks[0], checks[-1]] if (checks := metrics.get("collapse")) else None,
        "gate": {
            key: gate.get(key)
            for key in ("decision", "candidate_reward", "active_reward", "reasons", "waived")
            if key in gate
        }
        or None,
        "wall_s": metrics.get("wall_s"),
    }


def _describe_run(run: dict[str, Any]) -> str:
    gate = run["metrics"].get("gate") or {}
    text = f"training run {run['id']}: {run['status']}"
    if run.get("to_version") is not None:
        text += f", candidate v{run['to_version']}"
    if gate:
        text += (
            f", gate {gate.get('decision')} (reward {gate.get('candidate_reward')} vs "
            f"{gate.get('active_reward')})"
        )
        if gate.get("reasons"):
            text += f": {'; '.join(gate['reasons'])[:200]}"
    elif run.get("error"):
        text += f" ({run['error'][:200]})"
    return text


class Interruption:
    """Ctrl-C (SIGINT) and SIGTERM end the demo early, as the end of its time does: the traffic is cancelled (the
    cycle under way is not counted), then the gateway stops and the report is written. Only the first signal
    counts; one that comes while the demo is already stopping is logged, so a second Ctrl-C cannot leave the
    gateway and vLLM running."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.signal: signal.Signals | None = None
        self.stopping = False

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in self.SIGNALS:
            loop.add_signal_handler(signum, self._received, signum)

    def _received(self, signum: signal.Signals) -> None:
        if self.signal is not None or self.stopping:
            logger.warning("%s: already stopping; waiting for the gateway to stop", signum.name)
            return
        self.signal = signum
        logger.warning("%s: ending the demo; stopping the gateway and writing what it measured", signum.name)
        self.task.cancel()

    def caught(self) -> bool:
        """Whether a cancellation came from a signal (then it is taken back, and the demo winds down); any
        other cancellation goes on."""
        if self.signal is None:
            return False
        self.task.uncancel()
        return True


async def run_demo(
    options: DemoOptions,
    *,
    policy: dict[str, Any] | None = None,
    gateway_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start everything, run traffic cycles for `options.minutes` (or until `target_met`, when asked), stop, and
    write the report.

    `policy` replaces the demo's policy configuration and `gateway_env` adds to the gateway's environment: a
    benchmark runs the same traffic against another checkout's gateway and trainer with them."""
    out = options.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    options.data_dir.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "load_average_at_start": [round(v, 2) for v in os.getloadavg()]}
    logger.info("base model: %s; task: %s; load average %s", options.base_model, options.task, machine)
    base_path = await asyncio.to_thread(resolve_base_model, options.base_model, options.models_dir)
    secret = secrets.token_hex(16)
    log_path = (out or options.data_dir) / "gateway.log"
    gateway = GatewayProcess(
        options.data_dir,
        base_path,
        log_path,
        {
            "KAIZEN_FEEDBACK_SECRET": secret,
            "KAIZEN_SCHEDULER": "true",
            "KAIZEN_SCHEDULER_REFRESH_S": "2",
            **(gateway_env or {}),
        },
    )
    url, api_key = gateway.url, gateway.api_key
    current = asyncio.current_task()
    assert current is not None  # run_demo is always awaited by a task
    interruption = Interruption(current)
    interruption.install()
    split_cores(gateway.env, os.cpu_count() or 1)
    logger.info("starting the gateway on %s (log: %s)", url, log_path)
    gateway.start()
    cycles: list[Cycle] = []
    runs: list[dict[str, Any]] = []
    admin = httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {gateway.admin_key}"})
    app: SimulatedApp | None = None
    try:
        await gateway.wait_ready()
        config = policy if policy is not None else policy_config(options)
        await gateway.create_policy(POLICY, config)
        await wait_for_model(url, api_key, POLICY)
        logger.info("policy %r created (version 0 = the base model); traffic starts", POLICY)
        task = options.the_task
        app_options: dict[str, Any] = {
            "model": POLICY,
            "rate": options.rate,
            "concurrency": options.concurrency,
            "max_tokens": options.reply_tokens,
            "seed": options.seed,
        }
        app = (
            AgentApp(f"{url}/v1", api_key, secret, task.questions(), task=task, **app_options)
            if isinstance(task, AgentTask)
            else SimulatedApp(f"{url}/v1", api_key, secret, task.questions(), **app_options)
        )
        seen_runs: set[int] = set()
        deadline = time.monotonic() + options.minutes * 60
        while time.monotonic() < deadline:
            cycle = summarise(len(cycles) + 1, await app.cycle(options.cycle_calls))
            cycles.append(cycle)
            agent = (
                f", tool {cycle.tool_call_share:.2f} right call {cycle.right_call_share:.2f} "
                f"from result {cycle.answered_from_result_share:.2f}"
                if cycle.tool_call_share is not None
                else ""
            )
            logger.info(
                "cycle %3d  %6.0f s  served by v%s  mean reward %.3f  (%d calls, distinct %.2f, empty %.2f%s%s)",
                cycle.cycle,
                cycle.elapsed_s,
                cycle.version,
                cycle.mean_reward,
                cycle.n_calls,
                cycle.distinct_share,
                cycle.empty_share,
                agent,
                f", {cycle.errors} errors" if cycle.errors else "",
            )
            for run in await _new_runs(admin, url, seen_runs):
                logger.info("  %s", _describe_run(run))
                runs.append(run_record(run))
            summary = {**summarise_run(cycles, options, runs, policy), "machine": machine}
            if out is not None:
                write_json(out / "demo.json", cycles, summary)
            if options.stop_at_target and target_met(cycle, options.the_task):
                logger.info(
                    "v%s reached the target reward %.2f: stopping early",
                    cycle.version,
                    options.the_task.target_reward,
                )
                break
    except asyncio.CancelledError:
        if not interruption.caught():
            raise
    finally:
        interruption.stopping = True
        if app is not None:
            await app.close()
        await admin.aclose()
        logger.info("stopping the gateway")
        await asyncio.to_thread(gateway.stop)
    stopped_by = interruption.signal.name if interruption.signal is not None else None
    if not cycles:
        return {"stopped_by": stopped_by}
    summary = {**summarise_run(cycles, options, runs, policy, stopped_by), "machine": machine}
    if out is not None:
        write_json(out / "demo.json", cycles, summary)
        write_chart(
            out / "demo.png",
            cycles,
            f"kaizen demo ({options.task}): live reward, base {summary['base_reward']:.2f} -> "
            f"{summary['final_reward']:.2f} in {cycles[-1].elapsed_s / 60:.0f} min"
            + (f" (stopped by {stopped_by})" if stopped_by else ""),
        )
        logger.info("wrote %s and %s", out / "demo.json", out / "demo.png")
    return summary


def demo_main(
    options: DemoOptions,
    *,
    policy: dict[str, Any] | None = None,
    gateway_env: dict[str, str] | None = None,
) -> int:
    """`kaizen demo`: run it and print its targets as JSON. The exit status is 0, or 128 + the number of the
    signal that ended it early, as a shell reports a command stopped by one."""
    summary = asyncio.run(run_demo(options, policy=policy, gateway_env=gateway_env))
    sys.stdout.write(json.dumps(summary.get("targets", {}), indent=2) + "\n")
    stopped_by = summary.get("stopped_by")
    return 128 + signal.Signals[stopped_by] if stopped_by else 0
