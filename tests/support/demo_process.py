"""`kaizen demo`'s command path in a child process, over the scripted upstream (attached as the vLLM server) and without
training, for tests that stop it with a signal the way a user (Ctrl-C) or a supervisor (SIGTERM) would.

    python -m tests.support.demo_process OUT_DIR UPSTREAM_URL MODELS_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from gateway.commands.options import configure_logging
from gateway.demo.runner import DemoOptions, demo_main

#: No scheduled job: the test is about the traffic and the report, not the loop.
POLICY = {
    "rewards": {"scorer": {"function": "gateway.demo.tasks:score"}},
    "schedule": {
        "judge_interval_s": None,
        "train_cron": None,
        "train_min_new_episodes": None,
        "retention": {"cron": None},
    },
}

#: Calls per cycle: a few, quickly, so that cycles finish while the test waits.
CYCLE_CALLS = 6


def main(out: Path, upstream_url: str, models_dir: Path) -> int:
    configure_logging("info")
    options = DemoOptions(
        out=out,
        data_dir=out / "data",
        models_dir=models_dir,
        base_model="smollm2-135m-instruct",
        minutes=30,
        cycle_calls=CYCLE_CALLS,
        rate=20.0,
        concurrency=4,
    )
    # The scripted upstream stands in for an attached vLLM: it loads the policy's adapters by name.
    return demo_main(options, policy=POLICY, gateway_env={"KAIZEN_VLLM_URL": upstream_url})


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])))
