"""`kaizen bootstrap --policy P --task "..."`: make a new policy better than its base model before the first user
arrives (a cold start, as in AutoRL); with `--mcp SERVER`, an agent policy from its tools (MCP•RL).

1. A model writes varied scenarios for the task (`trainer.control.scenarios`: any litellm model, configured like
   RULER's judge, or the gateway's own engine); with `--mcp`, scenarios that need the tools of one of the
   policy's MCP servers, as the gateway lists them at `/mcp/<policy>`.
2. The policy answers each scenario several times through the gateway, with `X-Kaizen-Source: bootstrap`, so the
   attempts are captured like traffic, grouped per scenario, and stored as episodes of source `bootstrap`
   (visible in SQL and `GET /v1/episodes/{id}`, exportable like any other). With `--mcp` an attempt is a whole
   agent episode (`gateway.client.run_agent`): its tool calls go through `/mcp/<policy>`, so they are real and
   recorded in the episode, up to the policy's `train.max_turns` turns.
3. The policy's scorer scores the groups (`POST /admin/policies/P/judge`: RULER, a reward function or a webhook).
4. It trains on them (`POST /admin/policies/P/train`): GRPO when most groups have reward variance, an SFT warm
   start on the successes first when rewards are sparse. The candidate goes through the evaluation gate, on
   scenarios set aside for it, like any run.

Everything goes through the gateway's HTTP API (the Python client, `gateway.client`), with the admin key, so it
works against a remote gateway too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from gateway.commands.options import (
    add_common_options,
    configure_logging,
    load_settings,
    quiet_per_request_loggers,
)
from gateway.settings import Settings

log = logging.getLogger("kaizen")

SOURCE = "bootstrap"
#: Episode metadata key naming the bootstrap run, so its training selects exactly its own episodes.
RUN_KEY = "kaizen_bootstrap"
#: Share of groups with reward variance from which GRPO alone has enough signal (`--mode auto`).
GRPO_SIGNAL_SHARE = 0.5


@dataclass(frozen=True)
class BootstrapOptions:
    policy: str
    task: str | None
    gateway_url: str
    admin_key: str
    scenarios: int = 24
    attempts: int = 4
    eval_scenarios: int | None = None  # default: a fifth of the scenarios, 2 to 8
    system: str | None = None
    mode: str = "auto"  # auto | grpo | sft | warm_start | mixed
    max_tokens: int = 256
    temperature: float = 1.0
    seed: int | None = None
    concurrency: int = 8
    train: bool = True
    batch_size: int = 8
    #: The policy's MCP server (or `function`) whose tools the scenarios need; None: a one-answer task.
    mcp: str | None = None


@dataclass
class BootstrapReport:
    """What `kaizen bootstrap` did, printed as JSON at the end."""

    policy: str
    run_tag: str
    seed: int | None = None
    scenarios: int = 0
    eval_scenarios: int = 0
    episodes: int = 0
    writer_requests: int = 0
    duplicates_dropped: int = 0
    judge_run: int | None = None
    scored_episodes: int = 0
    mean_reward: float | None = None
    groups_with_signal: int = 0
    successes: int = 0
    mode: str | None = None
    train_run: int | None = None
    train_status: str | None = None
    version: int | None = None
    gate: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "bootstrap",
        help="Cold start a policy without traffic: a model writes scenarios for --task, the policy attempts "
        "each through the gateway (episodes of source `bootstrap`), its scorer scores them, and it trains.",
    )
    parser.add_argument("--policy", required=True, help="Policy to bootstrap (it must exist).")
    parser.add_argument(
        "--task", help="Plain-English description of what the policy is for (optional with --mcp)."
    )
    parser.add_argument(
        "--mcp",
        metavar="SERVER",
        help="Bootstrap an agent from the tools of this MCP server of the policy (`tools.servers[].name`, or "
        "`function` for its Python functions): scenarios that need them, attempted with real tool calls.",
    )
    parser.add_argument("--scenarios", type=int, default=24, help="Scenarios to write (default 24).")
    parser.add_argument("--attempts", type=int, default=4, help="Attempts per scenario, one group each (4).")
    parser.add_argument(
        "--eval-scenarios",
        type=int,
        help="Scenarios set aside for the evaluation gate (default: a fifth, 2 to 8).",
    )
    parser.add_argument("--system", help="System prompt every scenario is sent with (your app's own).")
    parser.add_argument(
        "--mode",
        choices=["auto", "grpo", "sft", "warm_start", "mixed"],
        default="auto",
        help="Training mode; auto: GRPO when most groups have reward variance, else an SFT warm start.",
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="Reply length cap of the attempts.")
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="Sampling temperature of the attempts."
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="Seed the scenario writer (its request k gets seed + k) and the attempts (attempt j of scenario i "
        "gets seed + i * attempts + j), so a rerun against engines that honour seeds writes the same scenarios "
        "and samples the same replies; default: unseeded.",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="Attempts in flight at once.")
    parser.add_argument("--no-train", action="store_true", help="Write, run and score the scenarios only.")
    parser.add_argument(
        "--writer-model", help="Model that writes the scenarios (litellm name; default KAIZEN_JUDGE_MODEL)."
    )
    parser.add_argument(
        "--writer-api-base", help="OpenAI-compatible URL of the writer (default KAIZEN_JUDGE_API_BASE)."
    )
    parser.add_argument(
        "--gateway-url",
        help="The gateway to bootstrap through (default: this one, as KAIZEN_GATE_URL or host and port).",
    )
    add_common_options(parser)
    parser.set_defaults(func=bootstrap_command)


def options_from_arguments(args: argparse.Namespace, settings: Settings) -> BootstrapOptions:
    from gateway.protocol import SEED_MAX
    from gateway.scheduling import gate_url

    if not settings.admin_key:
        raise ValueError("kaizen bootstrap needs the admin key (KAIZEN_ADMIN_KEY) of the gateway")
    for name in ("scenarios", "attempts", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.seed is not None and not 0 <= args.seed <= SEED_MAX - args.scenarios * args.attempts:
        raise ValueError(
            f"--seed must be between 0 and {SEED_MAX - args.scenarios * args.attempts}: each attempt is sent "
            "with its own seed above it, and the gateway takes seeds up to 2^63 - 1"
        )
    if args.attempts < 2 and not args.no_train:
        raise ValueError("--attempts must be at least 2: a group needs several attempts to compare")
    if not args.task and not args.mcp:
        raise ValueError(
            "give --task (what the policy is for), --mcp (the server whose tools it uses), or both"
        )
    return BootstrapOptions(
        policy=args.policy,
        task=args.task,
        gateway_url=args.gateway_url or gate_url(settings),
        admin_key=settings.admin_key,
        scenarios=args.scenarios,
        attempts=args.attempts,
        eval_scenarios=args.eval_scenarios,
        system=args.system,
        mode=args.mode,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        concurrency=args.concurrency,
        train=not args.no_train,
        mcp=args.mcp,
    )


def eval_count(options: BootstrapOptions) -> int:
    if options.eval_scenarios is not None:
        return max(0, min(options.eval_scenarios, options.scenarios - 1))
    return max(2, min(8, options.scenarios // 5)) if options.scenarios >= 4 else 0


def group_keys(tag: str, count: int, held_out: int, fraction: float) -> list[str]:
    """One group key per scenario; the first `held_out` hash into the gate's held-out share, the rest do not.

    Training leaves out exactly the groups the gate holds out (`trainer.control.gate.is_held_out`), so the gate judges
    the candidate on scenarios it never trained on."""
    from trainer.control.gate import is_held_out

    keys = []
    for index in range(count):
        wanted = index < held_out
        salt = 0
        while is_held_out(f"{tag}-{index}.{salt}", fraction) != wanted:
            salt += 1
        keys.append(f"{tag}-{index}.{salt}")
    return keys


def attempt_seed(base: int, scenario: int, attempt: int, attempts: int) -> int:
    """The seed of one attempt: distinct for every attempt of the run (the same seed would give a group identical
    replies, so no reward variance), and the same in every run with the same base."""
    return base + scenario * attempts + attempt


def choose_mode(requested: str, rewards: Sequence[Sequence[float]], min_reward: float) -> str | None:
    """The training mode for these groups' rewards; None when there is nothing to learn from."""
    with_signal = sum(1 for group in rewards if len(set(group)) > 1)
    successes = sum(1 for group in rewards for r in group if r >= min_reward)
    if requested != "auto":
        return requested
    if rewards and with_signal >= GRPO_SIGNAL_SHARE * len(rewards):
        return "grpo"
    if successes:
        return (
            "warm_start"  # few groups to compare: imitate the successes first, then GRPO on what has signal
        )
    return "grpo" if with_signal else None


async def bootstrap(options: BootstrapOptions, writer: Any, report: BootstrapReport) -> BootstrapReport:
    """Write, run, score and train; fills `report` as it goes (so a failure still shows what was done)."""
    from gateway.client import Model, Trajectory, gather, run_agent
    from trainer.control.policy_config import load_policy_config
    from trainer.control.ruler import import_litellm, takes_seed
    from trainer.control.scenarios import tools_task, write_scenarios

    model = Model(options.policy, options.gateway_url, api_key=options.admin_key, admin_key=options.admin_key)
    config = load_policy_config((await model.info()).get("config") or {})
    held_out = eval_count(options) if options.train else 0
    if held_out and config.gate.holdout_fraction <= 0:
        raise ValueError(
            f"policy {options.policy} holds no groups out for its evaluation gate (gate.holdout_fraction = 0), "
            "so its first candidate could not be evaluated; set it above 0, or pass --eval-scenarios 0 --no-train"
        )
    started = datetime.now(UTC) - timedelta(seconds=1)

    # 1. scenarios
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(
        total=options.scenarios, desc="writing scenarios", unit="scenario", file=sys.stderr, disable=None
    )

    def progress(done: int, total: int) -> None:
        bar.n = done
        bar.refresh()

    if writer.seed is not None and not takes_seed(await import_litellm(), writer):
        log.warning(
            "the scenario writer %s takes no seed: the attempts are seeded, the scenarios not", writer.model
        )
    task = options.task or ""
    if options.mcp is not None:
        offered = await _server_tools(model, options.mcp)
        task = tools_task(offered, options.task)
        log.info(
            "%d tools of %s: %s", len(offered), options.mcp, ", ".join(t["function"]["name"] for t in offered)
        )
    try:
        written = await write_scenarios(
            task,
            options.scenarios,
            writer,
            batch_size=options.batch_size,
            progress=progress,
        )
    finally:
        bar.close()
    report.scenarios = len(written.messages)
    report.writer_requests, report.duplicates_dropped = written.requests, written.duplicates
    held_out = min(held_out, max(report.scenarios - 1, 0))
    report.eval_scenarios = held_out
    keys = group_keys(report.run_tag, report.scenarios, held_out, config.gate.holdout_fraction)
    log.info("%d scenarios written (%d for the evaluation gate)", report.scenarios, held_out)

    # 2. attempts through the gateway, captured as episodes of source `bootstrap`
    index = {scenario: number for number, scenario in enumerate(written.messages)}  # the writer drops repeats
    started_attempts = dict.fromkeys(index, 0)

    async def attempt(trajectory: Trajectory, scenario: str) -> None:
        messages = [{"role": "user", "content": scenario}]
        if options.system:
            messages.insert(0, {"role": "system", "content": options.system})
        seed = None
        if options.seed is not None:
            seed = attempt_seed(options.seed, index[scenario], started_attempts[scenario], options.attempts)
            started_attempts[scenario] += 1
        if options.mcp is not None:
            async with model.tools(trajectory) as tools:
                await run_agent(
                    trajectory,
                    messages,
                    tools,
                    max_turns=config.train.max_turns,
                    source=options.mcp,
                    max_tokens=options.max_tokens,
                    temperature=options.temperature,
                    metadata={RUN_KEY: report.run_tag},
                    extra_headers={"X-Kaizen-Source": SOURCE},
                    extra_body={"seed": seed} if seed is not None else None,
                )
            return
        client = trajectory.async_openai_client(default_headers={"X-Kaizen-Source": SOURCE}, max_retries=2)
        try:
            await client.chat.completions.create(
                model=options.policy,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=options.max_tokens,
                temperature=options.temperature,
                metadata={RUN_KEY: report.run_tag},
                # `extra_body` leaves the field out when unseeded, on every SDK version the client supports
                extra_body={"seed": seed} if seed is not None else None,
            )
        finally:
            await client.close()

    groups = await gather(
        model,
        attempt,
        written.messages,
        attempts=options.attempts,
        concurrency=options.concurrency,
        group_keys=keys,
        desc="attempts",
    )
    report.episodes = sum(len(g.trajectories) for g in groups)

    # 3. scores
    log.info("scoring %d groups with the policy's scorer", len(groups))
    judged = await model.judge(groups)
    report.judge_run = judged.id
    if judged.status != "succeeded":
        raise RuntimeError(f"scoring failed (run {judged.id}): {judged.error}")
    rewards: list[list[float]] = []
    for group in groups[held_out:]:  # the groups training will see
        values = []
        for trajectory in group.trajectories:
            reward = (await model.episode(trajectory.episode_id)).get("reward")
            if reward is not None:
                values.append(float(reward))
        rewards.append(values)
    flat = [r for group in rewards for r in group]
    report.scored_episodes = len(flat)
    report.mean_reward = sum(flat) / len(flat) if flat else None
    report.groups_with_signal = sum(1 for g in rewards if len(set(g)) > 1)
    report.successes = sum(1 for r in flat if r >= config.train.sft_min_reward)
    log.info(
        "scored: mean reward %s, %d of %d training groups with reward variance, %d replies reach %.2f",
        f"{report.mean_reward:.3f}" if report.mean_reward is not None else "n/a",
        report.groups_with_signal,
        len(rewards),
        report.successes,
        config.train.sft_min_reward,
    )
    if not options.train:
        return report

    # 4. training, gated
    mode = choose_mode(options.mode, rewards, config.train.sft_min_reward)
    report.mode = mode
    if mode is None:
        report.notes.append("no group has reward variance and no reply succeeded: nothing to learn from")
        return report
    log.info("training in mode %s; the candidate then goes through the evaluation gate", mode)
    overrides = {
        "mode": mode,
        "grouping": "key",
        "group_size": options.attempts,
        "metadata": {RUN_KEY: report.run_tag},
    }
    clock = time.monotonic()
    run = await model.train(overrides=overrides, since=started)
    report.train_run, report.train_status = run.id, run.status
    report.version = run.to_version
    report.gate = run.gate
    if run.error:
        report.notes.append(run.error)
    log.info("training run %d: %s after %.0f s", run.id, run.status, time.monotonic() - clock)
    return report


async def _server_tools(model: Any, server: str) -> list[dict[str, Any]]:
    """The tools of the policy's MCP server `server`, as the gateway offers them; refused clearly when it has
    none (an unknown server, or one that did not start)."""
    async with model.tools() as tools:
        offered: list[dict[str, Any]] = tools.openai_tools(server)
        sources = sorted({t.source for t in tools.listed})
    if not offered:
        raise ValueError(
            f"policy {model.name} has no tools from {server!r} (its tools come from: {', '.join(sources) or 'none'}; "
            "an MCP server that does not start is left out, see the gateway's log)"
        )
    return offered


def bootstrap_command(args: argparse.Namespace) -> int:
    """Exit 0 when a candidate was promoted (or, with --no-train, the scenarios were scored), 3 otherwise."""
    from gateway.client import KaizenError
    from trainer.control.scenarios import ScenarioError

    settings = load_settings(args)
    configure_logging(settings.log_level)
    quiet_per_request_loggers("httpx", "httpx2", "openai", "LiteLLM")
    options = options_from_arguments(args, settings)
    judge = settings.judge()
    writer = replace(
        judge,
        model=args.writer_model or judge.model,
        api_base=args.writer_api_base or judge.api_base,
        temperature=1.0,
        seed=options.seed,
    )
    if not writer.model:
        raise ValueError("no scenario writer: pass --writer-model or set KAIZEN_JUDGE_MODEL")
    report = BootstrapReport(options.policy, f"{SOURCE}-{uuid.uuid4().hex[:8]}", seed=options.seed)
    try:
        asyncio.run(bootstrap(options, writer, report))
    except (KaizenError, ScenarioError, RuntimeError, TimeoutError) as exc:
        log.error("bootstrap: %s", exc)
        report.notes.append(str(exc))
        return 1
    finally:
        sys.stdout.write(json.dumps(asdict(report), indent=2) + "\n")
    promoted = report.gate is not None and report.gate.get("decision") == "promote"
    return 0 if promoted or (not options.train and report.scored_episodes) else 3
