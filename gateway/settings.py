"""The one typed settings object, read from ``KAIZEN_*`` environment variables and an optional TOML file.

Every entry point builds it once (``Settings.load``) and passes it down; nothing else reads the environment.
Each field's description is its documentation: the CLI help and the README table are generated from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

_SYNC_TO_ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "postgresql+psycopg2": "postgresql+asyncpg",
    "postgresql+psycopg": "postgresql+asyncpg",
}


def async_database_url(url: str) -> str:
    """Map a plain SQLAlchemy URL to the async driver the gateway uses (``sqlite://`` → ``sqlite+aiosqlite://``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a database URL: {url!r}")
    return f"{_SYNC_TO_ASYNC_DRIVERS.get(scheme, scheme)}://{rest}"


class Settings(BaseSettings):
    """Kaizen's configuration. Environment variables win over the TOML file, which wins over defaults."""

    model_config = SettingsConfigDict(env_prefix="KAIZEN_", extra="ignore", validate_default=True)
    toml_file: ClassVar[Path | None] = None

    # --- where things live
    data_dir: Path = Field(
        Path("kaizen-data"), description="Directory for the SQLite file, spool, models and adapters."
    )
    database_url: str = Field(
        "",
        description="SQLAlchemy URL. `sqlite:///…` and `postgresql://…` are mapped to the async drivers. "
        "Default: a SQLite file `kaizen.db` under the data directory.",
    )

    # --- serving
    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8000, ge=0, le=65535, description="Port the HTTP server listens on.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Logging level.")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated client API keys. When set, `Authorization: Bearer <key>` is required on /v1.",
    )
    admin_key: str = Field(
        "", description="Key for /admin routes (`Authorization: Bearer`). Empty disables them."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest accepted request body, in bytes."
    )
    max_n: int = Field(16, ge=1, description="Largest accepted `n` (choices per request).")

    # --- engine
    engine: Literal["upstream", "vllm"] = Field(
        "upstream",
        description="`upstream`: any OpenAI-compatible server; `vllm`: the vLLM engine with LoRA adapters.",
    )
    upstream_url: str = Field(
        "http://127.0.0.1:8001/v1", description="Base URL (ending in /v1) of the OpenAI-compatible upstream."
    )
    upstream_api_key: str = Field("", description="Bearer key sent to the upstream.")
    upstream_logprobs: bool = Field(
        True,
        description="Ask the upstream for per-token logprobs on every call (stored; stripped unless asked).",
    )
    upstream_token_ids: bool = Field(
        False, description="Ask the upstream for sampled token ids (`return_token_ids`, a vLLM extension)."
    )
    engine_timeout_s: float = Field(600.0, gt=0, description="Total time allowed for one engine call.")
    engine_connect_timeout_s: float = Field(5.0, gt=0, description="Time allowed to connect to the engine.")
    engine_max_connections: int = Field(1024, ge=1, description="Pooled connections to the engine.")
    models_refresh_s: float = Field(
        30.0, gt=0, description="How often the list of engine models is refreshed."
    )

    # --- capture
    capture_queue_size: int = Field(
        50_000, ge=1, description="Calls held in memory before new ones spill to the spool file."
    )
    capture_batch_size: int = Field(
        500, ge=1, description="Largest batch the capture writer inserts at once."
    )
    capture_flush_ms: float = Field(
        50.0, gt=0, description="Longest a captured call waits before its batch is written."
    )
    capture_retry_s: float = Field(
        1.0, gt=0, description="Pause between attempts to reach a database that is down."
    )
    stitch_cache_size: int = Field(
        100_000, ge=0, description="Recent conversation tails kept in memory for prefix stitching."
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @model_validator(mode="after")
    def _derive_database_url(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'kaizen.db').resolve()}"
        self.database_url = async_database_url(self.database_url)
        return self

    @property
    def spool_path(self) -> Path:
        return self.data_dir / "spool" / "calls.jsonl"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls.toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls.toml_file))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Settings:
        """Build the settings from the environment, the optional TOML file and explicit overrides (CLI flags)."""
        if config_file is not None and not config_file.is_file():
            raise FileNotFoundError(f"config file not found: {config_file}")
        scoped = type("Settings", (cls,), {"toml_file": config_file})
        return scoped(**{k: v for k, v in overrides.items() if v is not None})  # type: ignore[no-any-return]
