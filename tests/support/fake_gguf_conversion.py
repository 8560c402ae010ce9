"""A stand-in for `trainer.learner.gguf_conversion` in tests: a real child process speaking the same model-job
protocol (the job on stdin, the log on stderr, the exit status), without torch, in well under a second.

It writes a small `config.json` into the job's directory and appends the job to `--record` (one JSON line a
conversion). `--fail`: it logs `conversion failed` and exits `FAILED`, as a real conversion that breaks does.
`--started PATH --hold PATH`: it creates the first path and waits for the test to create the second.

    python -m tests.support.fake_gguf_conversion --record PATH [--fail] [--started PATH --hold PATH]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import msgspec

from tests.support.polling import wait_until
from trainer.control.model_jobs import (
    DONE,
    FAILED,
    GgufConversionJob,
    configure_child_logging,
    read_job,
    take_result_channel,
)

log = logging.getLogger("tests.fake_gguf_conversion")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--started", type=Path)
    parser.add_argument("--hold", type=Path)
    args = parser.parse_args()
    take_result_channel()
    job = read_job(GgufConversionJob)
    configure_child_logging(job.log_level)
    print("a library printing to stdout")  # must reach the log, not the result channel
    log.info("dequantising %s", job.gguf)
    with args.record.open("ab") as record:
        record.write(msgspec.json.encode(job) + b"\n")
    (Path(job.out_dir) / "config.json").write_text('{"model_type": "llama"}')
    if args.started is not None:
        args.started.touch()
    if args.hold is not None:
        wait_until(args.hold.exists, "the test to release the conversion")
    if args.fail:
        log.error("conversion failed")
        return FAILED
    return DONE


if __name__ == "__main__":
    sys.exit(main())
