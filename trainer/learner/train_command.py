"""`python -m trainer.learner --policy P ...`: one GRPO run of a policy, the process the scheduler starts for training.

Everything the run needs is an argument, except secrets, which are read from the environment under the same
names the gateway uses (so they never show in a process listing): ``KAIZEN_DATABASE_URL`` (when
``--database-url`` is not given), ``KAIZEN_API_KEYS`` (the first key authorises resampling calls to the
gateway), ``KAIZEN_FEEDBACK_SECRET`` (signs reward-webhook calls) and ``KAIZEN_JUDGE_API_KEY``.
`kaizen train` runs the same `train_policy` in-process, with the arguments taken from the gateway's settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from migrations.runner import upgrade_database
from storage.database import Database
from storage.policies import get_policy
from trainer.control.launch import ranks_from_environment
from trainer.control.rewards import policy_reward_config
from trainer.control.ruler import JudgeSettings
from trainer.control.scoring import Scorer
from trainer.control.signals import SigtermAsCtrlC
from trainer.learner.engine_sampling import EngineEndpoint
from trainer.learner.grouping import PolicyReplyScorer
from trainer.learner.job import TrainOutcome, TrainRequest, run_training

if TYPE_CHECKING:
    from trainer.learner.distributed import Followers

log = logging.getLogger(__name__)

#: Exit status when the run ended without a candidate (skipped or failed).
NO_CANDIDATE = 3


@dataclass(frozen=True)
class TrainingInputs:
    """What one run of a policy needs, spelled out (the trainer never reads the gateway's settings)."""

    policy: str
    database_url: str
    data_dir: Path
    judge: JudgeSettings
    #: `TrainConfig` keys overriding the policy's stored ``train`` config for this run.
    overrides: dict[str, Any] = field(default_factory=dict)
    since: datetime | None = None
    #: Resample through the serving gateway at this endpoint; None: with the trainer's own model.
    engine: EngineEndpoint | None = None
    webhook_secret: str = ""
    device: str | None = None


async def train_policy(
    inputs: TrainingInputs, base_model_path: Callable[[str], str] = str, followers: Followers | None = None
) -> TrainOutcome:
    """Run one training run; `base_model_path` maps the policy's base model to a local directory (or passes a
    Hugging Face id through). `followers`: this is rank 0 of several training processes (torchrun)."""
    await upgrade_database(inputs.database_url)
    database = Database(inputs.database_url)
    try:
        async with database.session() as session:
            policy = await get_policy(session, inputs.policy)
            if policy is None:
                raise ValueError(f"unknown policy {inputs.policy!r}")
            reward_config = await policy_reward_config(session, inputs.policy)
        scorer = Scorer(reward_config, inputs.judge, webhook_secret=inputs.webhook_secret)
        request = TrainRequest(
            policy=inputs.policy,
            data_dir=inputs.data_dir,
            base_model_path=await asyncio.to_thread(base_model_path, policy.base_model),
            overrides=inputs.overrides,
            since=inputs.since,
            scorer=PolicyReplyScorer(scorer, inputs.policy),
            sampler=inputs.engine,
            device=inputs.device,
            followers=followers,
        )
        outcome = await run_training(database, request)
    finally:
        await database.dispose()
    log.info("training run %d: %s %s", outcome.run_id, outcome.status, outcome.adapter_path or outcome.error)
    return outcome


def override_value(text: str) -> Any:
    """`--set` values are JSON when they parse (numbers, lists, objects), plain strings otherwise."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs as `TrainConfig` overrides."""
    return {key: override_value(value) for key, value in (item.split("=", 1) for item in items)}


def _since(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.learner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--policy", required=True, help="Policy to train.")
    parser.add_argument(
        "--database-url",
        help="Async SQLAlchemy URL: sqlite+aiosqlite:///... or postgresql+asyncpg://... "
        "(default: $KAIZEN_DATABASE_URL, as the gateway passes it).",
    )
    parser.add_argument("--data-dir", type=Path, required=True, help="Where adapters and logs are written.")
    parser.add_argument(
        "--base-model",
        help="Local directory (or Hugging Face id) of the policy's base model (default: as the policy names it).",
    )
    parser.add_argument("--since", type=_since, help="Train on episodes since this ISO date/time.")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="Override a TrainConfig key."
    )
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu).")
    parser.add_argument(
        "--engine-url",
        help="Resample through the gateway at this OpenAI URL (ending in /v1); default: the trainer's own model.",
    )
    parser.add_argument("--engine-max-n", type=int, default=16, help="The gateway's largest `n` per call.")
    parser.add_argument("--judge-model", default="", help="RULER judge model (litellm name).")
    parser.add_argument("--judge-api-base", help="The judge's API base URL.")
    parser.add_argument("--judge-temperature", type=float, default=0.0)
    parser.add_argument("--judge-timeout-s", type=float, default=120.0)
    parser.add_argument("--judge-max-retries", type=int, default=2)
    parser.add_argument("--judge-concurrency", type=int, default=4)
    parser.add_argument("--log-level", default="info")
    return parser


def inputs_from_arguments(args: argparse.Namespace, env: dict[str, str]) -> TrainingInputs:
    database_url = args.database_url or env.get("KAIZEN_DATABASE_URL", "")
    if not database_url:
        raise ValueError("no database: pass --database-url or set KAIZEN_DATABASE_URL")
    api_keys = [key.strip() for key in env.get("KAIZEN_API_KEYS", "").split(",") if key.strip()]
    judge = JudgeSettings(
        model=args.judge_model,
        api_base=args.judge_api_base or None,
        api_key=env.get("KAIZEN_JUDGE_API_KEY") or None,
        temperature=args.judge_temperature,
        timeout_s=args.judge_timeout_s,
        max_retries=args.judge_max_retries,
        concurrency=args.judge_concurrency,
    )
    engine = None
    if args.engine_url:
        engine = EngineEndpoint(args.engine_url, api_keys[0] if api_keys else None, max_n=args.engine_max_n)
    return TrainingInputs(
        policy=args.policy,
        database_url=database_url,
        data_dir=args.data_dir,
        judge=judge,
        overrides=parse_overrides(args.set),
        since=args.since,
        engine=engine,
        webhook_secret=env.get("KAIZEN_FEEDBACK_SECRET", ""),
        device=args.device,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when a candidate version was written, 3 when the run was skipped or failed, 2 on bad arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        inputs = inputs_from_arguments(args, dict(os.environ))
    except ValueError as exc:
        parser.error(str(exc))
    with SigtermAsCtrlC() as interrupt:
        try:
            return _train(args, inputs)
        except KeyboardInterrupt:
            log.error("training stopped by %s", interrupt.signal.name)
            return interrupt.exit_status


def _train(args: argparse.Namespace, inputs: TrainingInputs) -> int:
    base_model = args.base_model
    ranks = ranks_from_environment()
    if ranks is None:
        outcome = asyncio.run(train_policy(inputs, (lambda _: base_model) if base_model else str))
        return 0 if outcome.status == "succeeded" else NO_CANDIDATE
    # Started by torchrun: one of several processes training the same run (see trainer/learner/distributed.py).
    from trainer.learner.distributed import Followers, start, stop
    from trainer.learner.job import follow

    start(ranks)
    try:
        if not ranks.main:
            follow(ranks, args.device)
            return 0
        followers = Followers(ranks)
        try:
            outcome = asyncio.run(
                train_policy(inputs, (lambda _: base_model) if base_model else str, followers)
            )
        finally:
            followers.release()
        return 0 if outcome.status == "succeeded" else NO_CANDIDATE
    finally:
        stop()
