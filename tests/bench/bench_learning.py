"""Learning where successes are rare: `kaizen demo --task past-tense` before and after, with the same traffic.

First the task's base success rate is measured: every question asked `--base-samples` times of the embedded
model through a real `kaizen serve` (vLLM, temperature 1, the demo's reply cap). Then the demo runs once per
side for `--minutes` of live traffic, exactly as `kaizen demo` runs it (a real gateway with vLLM, the `openai`
SDK as the app, signed feedback, the schedule training on a threshold, the gate, hot reload):

* `before`: the gateway and trainer of the commit `--before-ref` (the code before rare-success resampling and
  the reward-aware collapse guard), unpacked with `git archive` into a temporary directory, with this tree's
  task module copied in so its reward function can score, and that commit's own demo policy configuration;
* `after`: this tree, with the demo's policy configuration as `kaizen demo` sets it.

The sides run one after the other (two vLLM servers and two trainers on one small machine would slow each
other down), so a full run takes about 2 x (`--minutes` + 2) + 5 minutes; `--parallel` runs them at the same
time, for a machine busy with other work, where both sides should see the same load. The results file says what ran:
task, base rate, settings, the machine's load at the start of each side, every cycle and every training run.

    python -m tests.bench.bench_learning [--task past-tense] [--minutes 30] [--sides before,after]
        [--out tests/bench/results/learning.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.support.older_tree import tree_env
from tests.support.older_tree import unpack as unpack_tree

logger = logging.getLogger("bench_learning")

ROOT = Path(__file__).resolve().parents[2]
#: `main` before this benchmark's changes: the code the `before` side runs.
BEFORE_REF = "cac96a07d016b0b5d93b75deff446f26deef0880"
TASK_MODULE = Path("gateway/demo/tasks.py")
SCORER = "gateway.demo.tasks:score"


def unpack(ref: str, target: Path) -> str:
    """The tree of `ref` under `target`, plus this tree's task module; returns the full commit id."""
    commit = unpack_tree(ref, target)
    shutil.copyfile(ROOT / TASK_MODULE, target / TASK_MODULE)
    return commit


def demo_policy(tree: Path, base_model: str, scorer: str = SCORER) -> dict[str, Any]:
    """The demo policy configuration of the code in `tree`, scoring with the reward function `scorer`."""
    script = (
        "import json, pathlib, sys\n"
        "import gateway, trainer\n"
        "from gateway.demo.runner import DemoOptions, policy_config\n"
        "options = DemoOptions(None, pathlib.Path('d'), pathlib.Path('m'), sys.argv[1])\n"
        "print(json.dumps([gateway.__file__, trainer.__file__, policy_config(options)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, base_model],
        env=tree_env(tree),
        check=True,
        capture_output=True,
        text=True,
    )
    *modules, found = json.loads(out.stdout)
    config: dict[str, Any] = found
    if not all(Path(module).is_relative_to(tree) for module in modules):
        raise RuntimeError(f"the `before` side would import {modules}, not the code under {tree}")
    config.setdefault("rewards", {}).setdefault("scorer", {})["function"] = scorer
    return config


async def base_rate(
    task_name: str, samples: int, max_tokens: int, base_model: str, work: Path
) -> dict[str, Any]:
    """The embedded model's success rate on every question of the task at temperature 1, through vLLM."""
    from openai import AsyncOpenAI

    from gateway.base_models import resolve_base_model
    from gateway.commands.serve_process import GatewayProcess
    from gateway.demo.runner import wait_for_model
    from gateway.demo.tasks import TASKS, reward
    from gateway.settings import Settings

    models = Settings().data_dir / "models"
    path = await asyncio.to_thread(resolve_base_model, base_model, models)
    gateway = GatewayProcess(work, path, work / "gateway.log", {"KAIZEN_SCHEDULER": "false"})
    gateway.start()
    questions = TASKS[task_name].questions()
    try:
        await gateway.wait_ready()
        await gateway.create_policy("base")
        await wait_for_model(gateway.url, gateway.api_key, "base")
        client = AsyncOpenAI(
            base_url=f"{gateway.url}/v1", api_key=gateway.api_key, max_retries=5, timeout=600
        )
        limit = asyncio.Semaphore(8)

        async def ask(prompt: str) -> list[str]:
            async with limit:
                answer = await client.chat.completions.create(
                    model="base",
                    messages=[{"role": "user", "content": prompt}],
                    n=samples,
                    max_tokens=max_tokens,
                    temperature=1.0,
                    extra_headers={"X-Kaizen-No-Log": "true"},
                )
            return [choice.message.content or "" for choice in answer.choices]

        started = time.monotonic()
        replies = await asyncio.gather(*(ask(q.prompt) for q in questions))
        await client.close()
    finally:
        await asyncio.to_thread(gateway.stop)
    rates = {q.key: sum(reward(r, q) for r in rs) / len(rs) for q, rs in zip(questions, replies, strict=True)}
    return {
        "rate": round(sum(rates.values()) / len(rates), 4),
        "replies": samples * len(questions),
        "questions_with_a_success": sum(1 for v in rates.values() if v > 0),
        "questions": len(questions),
        "samples_per_question": samples,
        "temperature": 1.0,
        "max_tokens": max_tokens,
        "examples": [rs[0] for rs in replies[:5]],
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
        task=args.task,
    )
    if side == "after":
        source: dict[str, Any] = {"tree": "this checkout", "commit": _head()}
        summary = await run_demo(options)
    else:
        tree = work / "before-tree"
        commit = await asyncio.to_thread(unpack, args.before_ref, tree)
        policy = await asyncio.to_thread(demo_policy, tree, settings.base_model)
        source = {"tree": f"git archive {commit[:12]} + {TASK_MODULE}", "commit": commit}
        # The other tree's gateway and trainer, with this install's vLLM environment.
        env = {**tree_env(tree), "KAIZEN_VLLM_PYTHON": find_vllm_python(settings.vllm_python)}
        summary = await run_demo(options, policy=policy, gateway_env=env)
    demo = json.loads((work / side / "demo.json").read_text())
    return {"source": source, "summary": summary, "cycles": demo["cycles"]}


def _head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def headline(side: dict[str, Any], target: float) -> dict[str, Any]:
    """The numbers the README quotes for one side."""
    summary, cycles = side["summary"], side["cycles"]
    reached = next((c for c in cycles if c["mean_reward"] >= target), None)
    return {
        "base_reward": summary["base_reward"],
        "final_reward": summary["final_reward"],
        "best_reward": summary["best_reward"],
        "reached_target_at_min": round(reached["elapsed_s"] / 60, 1) if reached else None,
        "versions_served": summary["versions_served"],
        "runs": dict(Counter(run["status"] for run in summary.get("runs", []))),
        "min_distinct_share_after_base": summary["min_distinct_share_after_base"],
        "max_empty_share": summary["max_empty_share"],
        "promotion_regressions": summary["promotion_regressions"],
        "load_average_at_start": summary.get("machine", {}).get("load_average_at_start"),
    }


def write_chart(path: Path, sides: dict[str, dict[str, Any]], title: str, target: float) -> None:
    import matplotlib

    from gateway.demo.report import save_chart

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5), dpi=120)
    for (name, side), colour in zip(sides.items(), ("tab:gray", "tab:blue"), strict=False):
        minutes = [c["elapsed_s"] / 60 for c in side["cycles"]]
        axes.plot(minutes, [c["mean_reward"] for c in side["cycles"]], marker="o", color=colour, label=name)
    axes.axhline(target, color="tab:green", ls=":", lw=1, label=f"target {target}")
    axes.set_ylim(0, 1.05)
    save_chart(figure, axes, path, title, ylabel="mean reward per cycle", legend="upper left")


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from gateway.demo.tasks import TASKS
    from gateway.settings import Settings

    task = TASKS[args.task]
    work = Path(tempfile.mkdtemp(prefix="kaizen-bench-learning-"))
    (work / "base-rate").mkdir()
    logger.info("work directory (logs, databases): %s", work)
    result: dict[str, Any] = {
        "task": {"name": task.name, "prompt": task.template, "questions": len(task.answers)},
        "minutes": args.minutes,
        "target": {"reward": task.target_reward, "minutes": task.target_minutes},
        "command": " ".join(["python -m tests.bench.bench_learning", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": [round(v, 2) for v in os.getloadavg()]},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sides": {},
    }
    if args.base_samples:
        logger.info("measuring the base success rate (%d replies per question)", args.base_samples)
        result["base_rate"] = await base_rate(
            args.task, args.base_samples, 16, Settings().base_model, work / "base-rate"
        )
        logger.info("base success rate: %s", result["base_rate"]["rate"])
        _write(args.out, result)
    sides = args.sides.split(",")
    result["parallel"] = args.parallel

    async def one(side: str) -> None:
        logger.info("side %s: %.0f minutes of traffic", side, args.minutes)
        result["sides"][side] = await run_side(side, args, work)
        result["sides"][side]["headline"] = headline(result["sides"][side], task.target_reward)
        _write(args.out, result)

    if args.parallel:
        await asyncio.gather(*(one(side) for side in sides))
    else:
        for side in sides:
            await one(side)
    chart = args.out.with_suffix(".png")
    write_chart(chart, result["sides"], f"{task.name}: live reward, before and after", task.target_reward)
    logger.info("wrote %s and %s", args.out, chart)
    return result


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="past-tense")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument(
        "--sides", default="before,after", help="Which sides, in order: before, after or both."
    )
    parser.add_argument("--before-ref", default=BEFORE_REF, help="The commit the `before` side runs.")
    parser.add_argument("--base-samples", type=int, default=8, help="Replies per question for the base rate.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="Run the sides at the same time: on a machine busy with other work both then see the same load "
        "(two vLLM servers: hold two of a shared machine's vLLM slots).",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "tests/bench/results/learning.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "openai"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    asyncio.run(benchmark(args))


if __name__ == "__main__":
    main()
