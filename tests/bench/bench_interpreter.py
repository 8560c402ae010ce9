"""The gateway on two builds of the same Python version, alternated in one `bench_overhead` run.

How the interpreter was built is a lever on the gateway's CPU per call that no code change gives: a shared
libpython without profile-guided optimisation (pyenv's default build) against a PGO build (Debian's and Ubuntu's
`python3`, the Docker image's). This makes a throwaway virtual environment of the other Python that loads this
environment's packages (the same minor version, so the same compiled wheels), and runs `bench_overhead` with one
gateway on each, one worker and a client key each. The load generator and the upstream run on this environment's
Python for both gateways and for the direct calls.

    python -m tests.bench.bench_interpreter [--other-python /usr/bin/python3] [--out FILE] [bench_overhead options]

Options it does not know go to `bench_overhead` (e.g. `--concurrency 1 32 --rounds 8`).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.bench import bench_overhead

logger = logging.getLogger("bench_interpreter")
DEFAULT_OUT = Path(__file__).parent / "results" / "overhead_interpreter.json"
_DESCRIBE = (
    "import json, sys, sysconfig; from gateway.machine import slow_interpreter_note; print(json.dumps({"
    "'executable': sys.executable, 'version': sys.version, 'cache_tag': sys.implementation.cache_tag, "
    "'config_args': sysconfig.get_config_var('CONFIG_ARGS'), 'plain_shared_build': slow_interpreter_note() "
    "is not None}))"
)


def describe(python: str) -> dict[str, Any]:
    """The interpreter's version and build, as that interpreter reports them (with this tree importable)."""
    done = subprocess.run([python, "-c", _DESCRIBE], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{python} could not describe itself: {done.stderr.strip()[-2000:]}")
    described: dict[str, Any] = json.loads(done.stdout)
    return described


def borrowing_environment(other_python: str, root: Path) -> str:
    """A virtual environment of `other_python` under `root` that loads this environment's packages; its python."""
    subprocess.run([other_python, "-m", "venv", "--without-pip", str(root)], check=True)
    purelib = Path(
        subprocess.run(
            [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # A .pth line that starts with `import` runs at start-up; addsitedir also reads this environment's own .pth
    # files, among them the editable install of Kaizen.
    (purelib / "kaizen-borrowed.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
    )
    return str(root / "bin" / "python")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--other-python", default="/usr/bin/python3", help="the interpreter to compare with")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    this = describe(sys.executable)
    with tempfile.TemporaryDirectory(prefix="kaizen-bench-python-") as scratch:
        other_python = borrowing_environment(args.other_python, Path(scratch) / "venv")
        other = describe(other_python)
        if other["cache_tag"] != this["cache_tag"]:
            raise SystemExit(
                f"{args.other_python} is {other['cache_tag']}, this environment {this['cache_tag']}: the packages "
                "installed here load only into the same Python version"
            )
        for name, described in (("this", this), ("other", other)):
            logger.info("%s: %s (%s)", name, described["executable"], described["version"].split()[0])
        variant = "{}:BENCH_PYTHON={},KAIZEN_WORKERS=1,KAIZEN_API_KEYS=bench"
        bench_overhead.main(
            [
                "--gateway-cmd",
                "sh -c 'exec \"$BENCH_PYTHON\" -m gateway serve'",
                "--variant",
                variant.format("this", sys.executable),
                "--variant",
                variant.format("other", other_python),
                "--api-key",
                "bench",
                "--cpu-split",
                "--out",
                str(args.out),
                *rest,
            ]
        )
    results = json.loads(args.out.read_text())
    results["interpreters"] = {"this": this, "other": other}
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
