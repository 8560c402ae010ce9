"""Shared fixtures: a throwaway PostgreSQL, the scripted upstream, and real gateways on loopback ports."""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import Settings, async_database_url
from migrations.runner import upgrade_database
from tests.support.gateway_server import GatewayServer
from tests.support.ports import free_port
from tests.support.postgres import PostgresServer, find_bin_dir
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.sql import fetch_rows


def pytest_configure(config: pytest.Config) -> None:
    """Every `kaizen serve` a test starts is one serving process unless the test asks for workers: the default
    follows the machine's cores, and a test that kills "the gateway" means one process."""
    os.environ.setdefault("KAIZEN_WORKERS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on the session's vLLM must say so with the `vllm` marker: `-m "not vllm"` (a machine without
    `.venv-vllm`, or a run of the fast part alone) must never start the engine. One test once lacked it."""
    unmarked = [
        item.nodeid
        for item in items
        if "vllm_server" in getattr(item, "fixturenames", ()) and item.get_closest_marker("vllm") is None
    ]
    if unmarked:
        raise pytest.UsageError("tests using vllm_server need @pytest.mark.vllm: " + ", ".join(unmarked))


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    bin_dir = find_bin_dir()
    if bin_dir is None:
        pytest.fail("PostgreSQL server binaries not found (install Debian's postgresql package)")
    server = PostgresServer(bin_dir)
    server.init()
    server.start()
    server.wait_ready()
    yield server
    server.destroy()


#: The PostgreSQL database at the schema's head that each test's database is copied from.
HEAD_TEMPLATE = "kaizen_head"


@pytest.fixture(scope="session")
def head_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database migrated to the schema's head once per session, for `database_url` to copy."""
    path = tmp_path_factory.mktemp("schema-head") / "kaizen.db"
    asyncio.run(upgrade_database(async_database_url(f"sqlite:///{path}")))
    return path


@pytest.fixture(scope="session")
def head_postgres(postgres: PostgresServer) -> str:
    """The name of a PostgreSQL database migrated to the schema's head once per session (a template)."""
    asyncio.run(upgrade_database(async_database_url(postgres.create_database(HEAD_TEMPLATE))))
    return HEAD_TEMPLATE


KINDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres_twin)]


def _fresh_database(request: pytest.FixtureRequest, tmp_path: Path, *, at_head: bool) -> str:
    """A new database of the kind `request.param` names: empty, or a copy of the session's one at head."""
    if request.param == "sqlite":
        path = tmp_path / "kaizen.db"
        if at_head:
            shutil.copyfile(request.getfixturevalue("head_sqlite"), path)
        return f"sqlite:///{path}"
    server: PostgresServer = request.getfixturevalue("postgres")
    template = request.getfixturevalue("head_postgres") if at_head else None
    return server.create_database("t_" + uuid.uuid4().hex[:12], template=template)


@pytest.fixture(params=KINDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database of each supported kind, already at the schema's head (a copy of a template): migrating
    one from empty takes 0.2 s on SQLite and 0.45 s on PostgreSQL, and most tests start a gateway on one."""
    return _fresh_database(request, tmp_path, at_head=True)


@pytest.fixture(params=KINDS)
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database of each supported kind: for tests of the migrations themselves."""
    return _fresh_database(request, tmp_path, at_head=False)


@pytest.fixture(scope="session")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as server:
        yield server


def query(url: str, sql: str, **params: Any) -> list[dict[str, Any]]:
    """Run a SQL query against a database the way a user would, and return plain dicts."""
    return asyncio.run(fetch_rows(url, sql, **params))


@pytest.fixture
def make_gateway(tmp_path: Path, upstream: ScriptedUpstream) -> Iterator[Callable[..., GatewayServer]]:
    """Start gateways with the given settings overrides; all are stopped at the end of the test."""
    started: list[GatewayServer] = []

    def make(database_url: str, **overrides: Any) -> GatewayServer:
        settings = Settings.load(
            data_dir=tmp_path / f"data{len(started)}",
            database_url=database_url,
            port=0,
            # The scripted upstream as the engine, asked for token ids; no background jobs unless a test asks for
            # them; quick capture unless it asks otherwise. A test may point at its own upstream, not ask it for
            # token ids, or attach a `vllm` engine (or engine replicas) to it.
            **{
                "engine": "upstream",
                "upstream_token_ids": True,
                "scheduler": False,
                "capture_flush_ms": 5.0,
                "capture_retry_s": 0.2,
                "upstream_url": upstream.url,
                **overrides,
            },
        )
        server = GatewayServer(settings).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


MODELS_DIR = Path(__file__).resolve().parents[1] / "kaizen-data" / "models"


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """The embedded base model as a Hugging Face directory, built once into the repo's (git-ignored) data dir."""
    from gateway.base_models import pull_base_model

    return pull_base_model("smollm2-135m-instruct", MODELS_DIR)


#: The admin key of the session's vLLM gateway (admin routes: training and judging runs, the gate).
VLLM_ADMIN_KEY = "vllm-admin"


@dataclass
class VLLMServer:
    """The session's real vLLM (CPU build), started and supervised by a real gateway."""

    gateway: GatewayServer
    url: str  # the engine's own OpenAI base URL, ending in /v1
    model: str  # the served base model name

    @property
    def data_dir(self) -> Path:
        return self.gateway.settings.data_dir


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, embedded_model: Path) -> Iterator[VLLMServer]:
    """One vLLM per test session (start-up takes ~40 s), behind a gateway with `KAIZEN_ENGINE=vllm`."""
    data = tmp_path_factory.mktemp("vllm-gateway")
    (data / "models").symlink_to(MODELS_DIR)
    port = free_port()
    settings = Settings.load(
        data_dir=data,
        database_url=f"sqlite:///{data / 'kaizen.db'}",
        engine="vllm",
        vllm_port=port,
        port=0,
        capture_flush_ms=5.0,
        policy_refresh_s=0.5,
        adapter_idle_unload_s=0.0,
        scheduler=False,
        admin_key=VLLM_ADMIN_KEY,  # /v1 stays open: no client key is set
    )
    gateway = GatewayServer(settings, startup_timeout_s=900).start()
    yield VLLMServer(gateway, f"http://127.0.0.1:{port}/v1", "smollm2-135m-instruct")
    gateway.stop()


#: How deep `small_model` is.
SMALL_MODEL_LAYERS = 2


@pytest.fixture(scope="session")
def small_model(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's tokenizer, chat template and architecture, two layers deep with random weights: for
    tests of a training run's mechanics (signals, locks, tracking, processes) rather than of what it learns. It
    loads and takes a step in a small fraction of the embedded model's time."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(embedded_model)
    config.update(
        {
            "num_hidden_layers": SMALL_MODEL_LAYERS,
            "hidden_size": 64,
            "intermediate_size": 128,
            "head_dim": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("small-model")
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(embedded_model / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer Llama with random weights and a word-level tokenizer: a real model for the trainer, in a second."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(64)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), pad_token="t0", eos_token="t1"
    )
    tokenizer.save_pretrained(path)
    return path
