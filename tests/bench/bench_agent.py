"""An agent learning from its own traffic: `kaizen demo --task lockers` before and after whole-episode training.

The task (gateway/demo/agent_tasks.py): "What is the secret word in locker 42?"; only the `open_locker` tool knows,
and its result names the locker's earlier word first. Each episode is an agent loop the app runs itself with the
`openai` SDK (first turn forced to call a tool, the app runs the calls, the model answers from the results) and
rewards once, by episode, through the signed feedback webhook.

First the base rates are measured: every question attempted `--base-samples` times by the embedded model through
a real `kaizen serve` (vLLM, temperature 1): success, and the share of episodes that called the tool, called it
with the right locker and answered from its result. Then the demo runs once per side for `--minutes` of live
traffic, exactly as `kaizen demo --task lockers` runs it:

* `before`: the gateway and trainer of `--before-ref` (the code before whole-episode groups, tools and MCP),
  unpacked with `git archive`, with this tree's task modules copied in so its reward function can score, and
  that commit's own demo policy configuration (it has no `tools` section: its trainer re-samples only the final
  turn); both sides allow the same reply length;
* `after`: this tree, with the demo's policy configuration as `kaizen demo` sets it.

The sides run one after the other (two vLLM servers and two trainers on one small machine would slow each other
down). The results file says what ran: the base rates, settings, the machine's load at the start of each side,
every cycle (with its agent shares) and every training run.

    python -m tests.bench.bench_agent [--minutes 30] [--sides before,after] [--out tests/bench/results/agent.json]
        [--add]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.bench.bench_learning import ROOT, demo_policy, headline, tree_env, unpack, write_chart

logger = logging.getLogger("bench_agent")

TASK = "lockers"
AGENT_MODULE = Path("gateway/demo/agent_tasks.py")
SCORER = "gateway.demo.agent_tasks:score"
#: The before side's demo answered in 16 tokens; a tool call takes about 30 of the embedded model's.
REPLY_TOKENS = 48
#: `main` just before whole-episode groups, tools and MCP: the layout of issue 40 done, nothing of issue 41.
BEFORE_CODE = "379d2af5265401295198da74891870748bb0b9da"


def before_policy(tree: Path, base_model: str) -> dict[str, Any]:
    """The demo policy configuration of the code in `tree`, scoring with the agent task's reward function, with
    this tree's reply length."""
    config = demo_policy(tree, base_model, SCORER)
    config["train"].update(max_new_tokens=REPLY_TOKENS, collapse_max_new_tokens=REPLY_TOKENS)
    config["gate"]["max_tokens"] = REPLY_TOKENS
    return config


async def base_rates(samples: int, base_model: str, work: Path) -> dict[str, Any]:
    """The embedded model's episodes on every question at temperature 1, through vLLM, no training."""
    from gateway.base_models import resolve_base_model
    from gateway.commands.serve_process import GatewayProcess
    from gateway.demo.agent_tasks import LOCKER_TASK
    from gateway.demo.runner import wait_for_model
    from gateway.demo.traffic import AgentApp
    from gateway.settings import Settings

    models = Settings().data_dir / "models"
    path = await asyncio.to_thread(resolve_base_model, base_model, models)
    secret = secrets.token_hex(16)
    env = {"KAIZEN_SCHEDULER": "false", "KAIZEN_FEEDBACK_SECRET": secret}
    gateway = GatewayProcess(work, path, work / "gateway.log", env)
    gateway.start()
    questions = LOCKER_TASK.questions()
    try:
        await gateway.wait_ready()
        await gateway.create_policy("base")
        await wait_for_model(gateway.url, gateway.api_key, "base")
        app = AgentApp(
            f"{gateway.url}/v1",
            gateway.api_key,
            secret,
            questions,
            task=LOCKER_TASK,
            model="base",
            rate=100.0,
            concurrency=8,
            max_tokens=REPLY_TOKENS,
            seed=0,
        )
        started = time.monotonic()
        limit = asyncio.Semaphore(8)

        async def attempt(question: Any) -> Any:
            async with limit:
                return await app._call(question)

        results = await asyncio.gather(*(attempt(q) for q in questions for _ in range(samples)))
        await app.close()
    finally:
        await asyncio.to_thread(gateway.stop)
    answered = [r for r in results if r.error is None]

    def share(values: list[bool]) -> float:
        return round(sum(values) / len(values), 4) if values else 0.0

    return {
        "success": share([r.reward == 1.0 for r in answered]),
        "tool_call_share": share([bool(r.called_tool) for r in answered]),
        "right_call_share": share([bool(r.right_call) for r in answered]),
        "answered_from_result_share": share([bool(r.answered_from_result) for r in answered]),
        "episodes": len(results),
        "errors": len(results) - len(answered),
        "samples_per_question": samples,
        "questions": len(questions),
        "examples": [r.reply for r in answered[:5]],
        "wall_s": round(time.monotonic() - started, 1),
    }


async def run_side(side: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from gateway.demo.runner import DemoOptions, run_demo
    from gateway.engines.vllm import find_vllm_python
    from gateway.settings import Settings

    settings = Settings()
    options = DemoOptions(
        out=work / side,
        data_dir=work / side / "data",
        models_dir=settings.data_dir / "models",
        base_model=settings.base_model,
        minutes=args.minutes,
        seed=args.seed,
        task=TASK,
        max_tokens=REPLY_TOKENS,
    )
    if side == "after":
        source: dict[str, Any] = {"tree": "this checkout", "commit": _head()}
        summary = await run_demo(options)
    else:
        tree = work / "before-tree"
        commit = await asyncio.to_thread(unpack, args.before_ref, tree)
        shutil.copyfile(ROOT / AGENT_MODULE, tree / AGENT_MODULE)
        policy = await asyncio.to_thread(before_policy, tree, settings.base_model)
        source = {"tree": f"git archive {commit[:12]} + {AGENT_MODULE}", "commit": commit}
        env = {**tree_env(tree), "KAIZEN_VLLM_PYTHON": find_vllm_python(settings.vllm_python)}
        summary = await run_demo(options, policy=policy, gateway_env=env)
    demo = json.loads((work / side / "demo.json").read_text())
    return {"source": source, "summary": summary, "cycles": demo["cycles"]}


def _head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from gateway.demo.agent_tasks import LOCKER_TASK
    from gateway.settings import Settings

    work = Path(tempfile.mkdtemp(prefix="kaizen-bench-agent-"))
    (work / "base-rate").mkdir()
    logger.info("work directory (logs, databases): %s", work)
    earlier = json.loads(args.out.read_text()) if args.add and args.out.exists() else {}
    result: dict[str, Any] = {
        "task": {"name": TASK, "questions": len(LOCKER_TASK.questions()), "tool": LOCKER_TASK.tool},
        "minutes": args.minutes,
        "target": {"reward": LOCKER_TASK.target_reward, "minutes": LOCKER_TASK.target_minutes},
        "command": " ".join(["python -m tests.bench.bench_agent", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": [round(v, 2) for v in os.getloadavg()]},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sides": {},
    }
    if earlier:
        # Sides measured by an earlier run stay, each with its own commit and start time.
        logger.info("adding to %s, which holds %s", args.out, ", ".join(earlier["sides"]) or "no side")
        result["sides"] = earlier["sides"]
        result["earlier_runs"] = [
            *earlier.get("earlier_runs", []),
            {k: earlier[k] for k in ("command", "machine", "started_at") if k in earlier},
        ]
        if "base_rate" in earlier:
            result["base_rate"] = earlier["base_rate"]
    if args.base_samples and "base_rate" not in result:
        logger.info("measuring the base rates (%d episodes per question)", args.base_samples)
        result["base_rate"] = await base_rates(args.base_samples, Settings().base_model, work / "base-rate")
        logger.info("base rates: %s", {k: v for k, v in result["base_rate"].items() if k != "examples"})
        _write(args.out, result)
    for side in args.sides.split(","):
        logger.info("side %s: %.0f minutes of traffic", side, args.minutes)
        result["sides"][side] = await run_side(side, args, work)
        summary = result["sides"][side]["summary"]
        result["sides"][side]["headline"] = {
            **headline(result["sides"][side], LOCKER_TASK.target_reward),
            "agent_shares": summary.get("agent_shares"),
        }
        _write(args.out, result)
    chart = args.out.with_suffix(".png")
    title = f"{TASK}: live reward of an agent's episodes, before and after"
    write_chart(chart, result["sides"], title, LOCKER_TASK.target_reward)
    logger.info("wrote %s and %s", args.out, chart)
    return result


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument(
        "--sides", default="before,after", help="Which sides, in order: before, after or both."
    )
    parser.add_argument("--before-ref", default=BEFORE_CODE, help="The commit the `before` side runs.")
    parser.add_argument(
        "--base-samples", type=int, default=4, help="Episodes per question for the base rates."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "tests/bench/results/agent.json")
    parser.add_argument(
        "--add",
        action="store_true",
        help="Keep the sides and base rates already in --out (run the sides one at a time).",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "httpx2", "openai"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    asyncio.run(benchmark(args))


if __name__ == "__main__":
    main()
