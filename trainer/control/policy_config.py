"""A policy's configuration: one typed `PolicyConfig`, stored as the JSON object `policies.config`.

Sections: `rewards` (how feedback becomes a reward, how unrewarded trajectories are scored), `train` (one training
run: GRPO, SFT or both), `schedule` (when jobs run), `gate` (how a candidate is evaluated) and `privacy` (what is redacted before a
call is stored). Every key has a default, so `{}` is a
complete configuration; unknown keys and wrong values are refused, all of them at once, by `load_policy_config`
raising `InvalidPolicyConfig`.

It is part of the trainer's control plane because it configures what the trainer does (rewards, GRPO,
scheduler, gate); the gateway imports it to validate what admins write and to turn feedback into numbers.
Storage keeps the raw JSON and never needs the type. The serving process imports this module, so it stays free
of torch and polars: it depends only on pydantic, the standard library, the torch-free health signals
(`trainer.control.collapse`) and the URL checks of `trainer.control.outbound` (httpx); the loss and advantage defaults are defined here for the learner to import.

The training defaults are chosen for small LoRA updates on off-policy production data, and for not shipping a
collapsed adapter: measured on the embedded 135M model, GRPO on format rewards reached 0.8 reward within
minutes at lr 1e-4 to 3e-4 and then collapsed (constant, empty or nonsense replies); lr 1e-3 collapsed within
5 steps. The schedule defaults close the loop without anyone watching: judge new traffic hourly, train nightly,
prune old calls and unused versions daily.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer.control.collapse import CollapseBounds
from trainer.control.live_health import HEALTH_BOUND_NAMES, HealthBounds
from trainer.control.outbound import url_problem

# --- loss defaults (used by `trainer.learner.loss` as its own defaults)

#: Lower PPO clip ε_low: the usual PPO value; limits how far one update can push a token's
#: probability down relative to π_old.
CLIP_LOW = 0.2
#: Upper clip ε_high > ε_low ("clip-higher", DAPO, Yu et al. 2025): a symmetric clip caps how much
#: a low-probability token can gain in one step, which starves exploration and drives entropy
#: collapse; a slightly larger upper bound leaves room for unlikely-but-good tokens to rise.
CLIP_HIGH = 0.28
#: Cap C of the truncated importance weight min(π_old/μ, C). Truncated importance sampling (the
#: "off-policy RL / TIS" line of work on sampler-trainer mismatch) corrects for data drawn from a
#: different policy while bounding the variance that one unlikely-under-μ token could inject.
#: 2.0 follows that work; the weight is only truncated above, so tokens the behaviour policy
#: over-sampled are still down-weighted.
TIS_CAP = 2.0
#: KL penalty to the base model is off by default: the clip and the LoRA's small capacity already
#: keep the policy near the base, DAPO and Dr. GRPO drop the term, and the reference forward pass
#: costs an extra model evaluation. Collapse is watched by ``trainer.control.collapse`` instead.
KL_COEF = 0.0
#: Default for ``scale_by_std`` (`trainer.learner.advantages`). Dr. GRPO ("Understanding R1-Zero-Like Training", Liu et al., 2025)
#: argues that dividing by the group's reward standard deviation is a bias, not a normalisation:
#: groups whose rewards barely differ (nearly all right or nearly all wrong, i.e. tasks that are
#: too easy or too hard) get their small differences blown up to unit scale, so they dominate the
#: update over groups with an informative spread. Plain mean-centring keeps the advantage in reward
#: units and weighs every group by how much its attempts actually differed.
SCALE_BY_STD_DEFAULT = False

# --- rewards

DEFAULT_RUBRIC = """\
- A trajectory that achieves the user's goal scores higher than one that does not.
- Among trajectories that achieve the goal, prefer the one that is more correct, complete and efficient \
(fewer wasted steps or tool calls, no invented facts).
- A trajectory that fails, refuses without reason, or gives a wrong answer scores low, but one that makes \
real progress scores higher than one that makes none.
- Judge only what the trajectory did, not how long or polite it is.
- Use the whole range from 0 to 1; give similar scores only to trajectories of similar quality."""

# Order in which signal sources win under the `priority` rule (first source with a signal decides).
DEFAULT_PRIORITY = ["feedback", "function", "webhook", "judge"]

_COLLAPSE_BOUNDS = frozenset(f.name for f in dataclasses.fields(CollapseBounds))


class _Section(BaseModel):
    """Unknown keys are errors: a typo must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid")


def _known_bounds(value: dict[str, float]) -> dict[str, float]:
    unknown = sorted(set(value) - _COLLAPSE_BOUNDS)
    if unknown:
        raise ValueError(f"unknown collapse bounds {unknown} (known: {', '.join(sorted(_COLLAPSE_BOUNDS))})")
    return value


def parse_cron(expression: str) -> Any:
    """An APScheduler trigger for a 5-field crontab line, in UTC (raises ValueError when malformed)."""
    from apscheduler.triggers.cron import CronTrigger

    return CronTrigger.from_crontab(expression, timezone="UTC")


def _valid_cron(value: str | None) -> str | None:
    if value is not None:
        parse_cron(value)
    return value


def _outbound_url(value: str | None) -> str | None:
    """A URL Kaizen sends trajectories to: http(s) with a host; empty means unset. Which addresses it may
    reach is checked where the policy is created and at every call (`trainer.control.outbound`)."""
    if not value:
        return None
    problem = url_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


class FeedbackConfig(_Section):
    """How a feedback value becomes a number, and which numbers are accepted."""

    labels: dict[str, float] = Field(
        default_factory=lambda: {"good": 1.0, "bad": 0.0, "thumbs_up": 1.0, "thumbs_down": 0.0},
        description="Label feedback values and the numbers they stand for.",
    )
    true_value: float = Field(1.0, description="The number for a thumbs up (`true`).")
    false_value: float = Field(0.0, description="The number for a thumbs down (`false`).")
    min_value: float | None = Field(
        None, description="Numeric values below are rejected (labels and thumbs are trusted)."
    )
    max_value: float | None = Field(None, description="Numeric values above are rejected.")


class RewardRule(_Section):
    """How an episode's training reward is derived from its signals.

    `priority`: the first source in `priority` that has any signal decides; within it, the latest value of
    each reward name counts and the names are averaged. `weighted`: every term of `weights` (a source such as
    `judge`, or `source:name` such as `feedback:user`) with a signal contributes its latest value times its
    weight; with `normalize` the sum is divided by the weights present (a weighted mean).
    """

    kind: Literal["priority", "weighted"] = Field("priority", description="`priority` or `weighted`.")
    priority: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PRIORITY), description="Sources in order, for `priority`."
    )
    weights: dict[str, float] = Field(
        default_factory=dict, description="`source` or `source:name` → weight, for `weighted`."
    )
    normalize: bool = Field(True, description="Divide the weighted sum by the weights present.")


class ScorerConfig(_Section):
    """How trajectories nobody gives feedback for are scored: the first of function, webhook, RULER that is set."""

    function: str | None = Field(
        None, description="`package.module:function`: receives the trajectory dict, returns a number."
    )
    webhook_url: str | None = Field(
        None, description='Kaizen POSTs the signed trajectory here and reads back {"score": x}.'
    )
    webhook_timeout_s: float = Field(30.0, description="Time allowed for one webhook call.")
    webhook_retries: int = Field(2, description="Retries of a failed webhook call.")
    min_group_size: int = Field(
        2, description="RULER compares trajectories: smaller groups wait for more attempts."
    )

    _url = field_validator("webhook_url")(_outbound_url)

    @property
    def kind(self) -> Literal["function", "webhook", "judge"]:
        if self.function:
            return "function"
        if self.webhook_url:
            return "webhook"
        return "judge"


class JudgeConfig(_Section):
    """Per-policy RULER settings; unset fields fall back to the process-wide `KAIZEN_JUDGE_*` settings."""

    rubric: str = Field(DEFAULT_RUBRIC, description="What RULER rewards (a default rubric ships).")
    model: str | None = Field(None, description="Judge model; default `KAIZEN_JUDGE_MODEL`.")
    api_base: str | None = Field(
        None, description="OpenAI-compatible judge endpoint (ending in /v1); default `KAIZEN_JUDGE_API_BASE`."
    )

    _url = field_validator("api_base")(_outbound_url)


class RewardConfig(_Section):
    """Per-policy reward configuration: thumbs map to 1/0, a few common labels map to numbers, explicit
    feedback wins over scorers and the judge, and RULER with the default rubric scores the rest."""

    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig)
    rule: RewardRule = Field(default_factory=RewardRule)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)


# --- train

Grouping = Literal["resample", "key", "prompt"]
#: What a run optimises: see `TrainConfig.mode` and trainer/learner/sft.py.
TrainMode = Literal["grpo", "sft", "warm_start", "mixed"]


class TrainConfig(_Section):
    """Everything one training run of a policy needs besides its data."""

    # --- data
    grouping: Grouping = Field(
        "resample",
        description="`resample` (production default: each attempt's task rolled out again, whole agent "
        "episodes included), `key` (same group_key), `prompt` (same first context).",
    )
    group_size: int = Field(8, ge=2, description="k: attempts per group; `resample` rolls out k-1 new ones.")
    min_group_size: int = Field(2, ge=2, description="Smaller `key`/`prompt` groups are dropped.")
    max_episodes: int = Field(
        512, ge=1, description="Cap on selected episodes (the newest win); `resample_budget` caps the cost."
    )
    min_rewards: int = Field(0, ge=0, description="Episodes with fewer reward rows are left out.")
    tags: list[str] = Field(default_factory=list, description="Only episodes carrying all these tags.")
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Only episodes whose metadata has these values."
    )
    max_length: int = Field(2048, ge=16, description="Longest trajectory in tokens.")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="What to do with longer trajectories."
    )
    max_new_tokens: int = Field(
        256, ge=1, description="Reply length cap when resampling and for collapse checks."
    )
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature for resampling (1.0 keeps logprobs exact)."
    )
    resample_concurrency: int = Field(
        8,
        ge=1,
        description="Contexts resampled and scored at once through the engine (the local sampler: 1).",
    )
    resample_budget: int = Field(
        512,
        ge=0,
        description="Most replies one `resample` run draws, over every context and round: first each context "
        "is topped up to `group_size`, then groups without reward variance get more.",
    )
    resample_max_group_size: int = Field(
        32,
        ge=2,
        description="A context whose replies all scored the same is resampled up to this many replies, "
        "`group_size` at a time (at most `group_size` when smaller).",
    )
    max_turns: int = Field(
        8,
        ge=1,
        description="Most assistant turns a rollout of an agent episode takes (resampling, the gate); one that "
        "is still calling tools then ends there and is scored as it stands.",
    )

    # --- LoRA
    lora_rank: int = Field(
        16, ge=1, description="LoRA rank; RL moves few bits per sample, small ranks suffice."
    )
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha (2 × rank, the common scaling).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout would make π_old ≠ πθ at ratio 1.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="All linear layers: LoRA on MLPs too matches full fine-tuning much better than attention-only.",
    )

    # --- optimisation
    learning_rate: float = Field(5e-5, gt=0, description="Below the 1e-4 where collapse was measured.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay on LoRA weights.")
    max_grad_norm: float = Field(
        1.0, gt=0, description="Gradient clipping: one extreme batch cannot wreck the adapter."
    )
    epochs: int = Field(
        1, ge=1, description="Passes over the data; later passes use the first pass's logprobs as π_old."
    )
    micro_batch_size: int = Field(8, ge=1, description="Trajectories per forward/backward.")
    grad_accumulation: int = Field(4, ge=1, description="Micro-batches per optimizer step.")
    loss_mode: Literal["ppo", "cispo"] = Field("ppo", description="`ppo` clipped surrogate or `cispo`.")
    clip_low: float = Field(CLIP_LOW, gt=0, description="PPO ε_low.")
    clip_high: float = Field(CLIP_HIGH, gt=0, description="ε_high > ε_low (clip-higher, DAPO).")
    tis_cap: float = Field(
        TIS_CAP, gt=0, description="Cap of the truncated importance weight vs behaviour logprobs."
    )
    kl_coef: float = Field(
        KL_COEF, ge=0, description="KL penalty to the base model (adapter disabled); 0 = off."
    )
    scale_by_std: bool = Field(
        SCALE_BY_STD_DEFAULT, description="Divide advantages by the group's std (off: Dr. GRPO)."
    )
    seed: int = Field(0, description="Seeds sampling, shuffling and LoRA init.")
    sharding: Literal["fsdp", "ddp"] = Field(
        "fsdp",
        description="With several training processes (KAIZEN_TRAIN_PROCESSES, or torchrun): `fsdp` shards the "
        "frozen base across them (a base too big for one GPU), `ddp` gives each a whole copy (faster when it fits).",
    )
    loader: Literal["peft", "unsloth"] = Field(
        "peft",
        description="What loads the base on a CUDA GPU: `peft` (transformers + PEFT) or `unsloth` (the `gpu` extra; "
        "opt-in, as it was not faster on an H100). Elsewhere, or where Unsloth is not installed, always `peft`.",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Compile each decoder layer for the training passes (torch.compile): `auto` on a CUDA GPU for "
        "a run of at least 500 forward and backward passes, which pays for the compilation (about 45 s on an "
        "H100; then 1.7x the steps per second at a 3B shape), unless Unsloth loads the base; `on` always (a CPU "
        "gains little); `off` never. Only with one training process.",
    )

    # --- what went well: supervised fine-tuning on demonstrations (trainer/learner/sft.py)
    mode: TrainMode = Field(
        "grpo",
        description="`grpo`: policy gradient on groups; `sft`: fine-tune on demonstrations only (no groups); "
        "`warm_start`: SFT on them, then GRPO, in one run; `mixed`: both losses in every optimizer step.",
    )
    sft_min_reward: float = Field(
        0.8,
        description="A reply (captured or resampled) is a demonstration when its reward is at least this.",
    )
    sft_per_context: int = Field(
        1, ge=1, description="Most demonstrations per task (group or prompt), the best-rewarded first."
    )
    sft_max_examples: int = Field(256, ge=1, description="Cap on demonstrations per run (the best win).")
    sft_learning_rate: float = Field(
        1e-4, gt=0, description="Learning rate of the SFT phase (`sft`, `warm_start`)."
    )
    sft_epochs: int = Field(2, ge=1, description="Passes over the demonstrations (`sft`, `warm_start`).")
    sft_coef: float = Field(
        0.1, ge=0, description="`mixed`: weight of a demonstration token's NLL against a GRPO token's loss."
    )
    demonstration_sources: list[str] = Field(
        default_factory=lambda: ["import"],
        description="Unrewarded episodes from these sources (`episodes.source`) are demonstrations too: "
        "conversations a team imported to teach. Rewarded ones must reach `sft_min_reward` like any other.",
    )

    # --- collapse guard
    collapse_check_every: int = Field(
        4, ge=0, description="Optimizer steps between collapse checks (0: only at the end)."
    )
    collapse_prompts: int = Field(4, ge=1, description="Prompts sampled for a collapse check.")
    collapse_samples: int = Field(4, ge=1, description="Replies per prompt for a collapse check.")
    collapse_max_new_tokens: int = Field(64, ge=1, description="Reply length cap in collapse checks.")
    collapse_bounds: dict[str, float] = Field(
        default_factory=dict, description="Overrides of trainer.control.collapse.CollapseBounds fields."
    )

    # --- experiment tracking (trainer/learner/tracking.py)
    tracking: Literal["none", "mlflow", "wandb"] = Field(
        "none",
        description="Mirror each run to MLflow or W&B (the `tracking` extra); the destination comes from "
        "their own env vars (MLFLOW_TRACKING_URI; WANDB_API_KEY, WANDB_MODE, WANDB_DIR).",
    )
    tracking_project: str | None = Field(
        None, min_length=1, description="MLflow experiment / W&B project; default `kaizen-<policy>`."
    )

    # --- bookkeeping
    lock_ttl_s: float = Field(120.0, gt=0, description="A lock not renewed for this long is taken over.")

    _bounds = field_validator("collapse_bounds")(_known_bounds)

    def bounds(self) -> CollapseBounds:
        return CollapseBounds(**self.collapse_bounds)


# --- schedule


class RetentionConfig(_Section):
    cron: str | None = Field("30 4 * * *", description="When retention runs (crontab, UTC); null: never.")
    calls_days: float | None = Field(
        90, gt=0, description="Delete calls (and their episodes and rewards) older than this; null: keep."
    )
    keep_versions: int = Field(
        5, ge=1, description="Keep the newest this many versions; the active and pinned ones are always kept."
    )

    _cron = field_validator("cron")(_valid_cron)


class ScheduleConfig(_Section):
    """When the scheduler runs a policy's jobs. One job of a policy runs at a time, in any process."""

    paused: bool = Field(False, description="No scheduled job of this policy runs (manual runs still do).")
    judge_interval_s: float | None = Field(
        3600.0, gt=0, description="Score unscored groups this often; null: never on a schedule."
    )
    judge_quiet_s: float = Field(
        120.0,
        ge=0,
        description="A scheduled judge run leaves a group for a later run while one of its episodes had a call "
        "in the last this many seconds: an agent still at work would be judged on part of its run. Manual runs "
        "judge at once. 0: scheduled runs do too.",
    )
    train_cron: str | None = Field(
        "0 3 * * *", description="Train at these times (crontab, UTC; default nightly); null: no cron."
    )
    train_min_new_episodes: int | None = Field(
        None,
        ge=1,
        description="Also train as soon as this many episodes were rewarded since the last run; null: off.",
    )
    threshold_check_s: float = Field(
        300.0, gt=0, description="How often the new-episode threshold is checked."
    )
    misfire_grace_s: float = Field(
        3600.0,
        gt=0,
        description="A run that could not start on time still runs this late (once, however many were missed).",
    )
    retention: RetentionConfig = Field(default_factory=RetentionConfig)

    _cron = field_validator("train_cron")(_valid_cron)


# --- gate


class GateConfig(_Section):
    """How a candidate version is evaluated against the active one (see `trainer.control.gate`)."""

    holdout_fraction: float = Field(
        0.1, ge=0, lt=1, description="Share of groups (by a hash of their key) kept out of training."
    )
    max_groups: int = Field(8, ge=1, description="Held-out contexts evaluated, the newest first.")
    samples: int = Field(
        4, ge=1, description="Replies per context from each version (one when temperature is 0)."
    )
    max_tokens: int = Field(128, ge=1, description="Reply length cap when sampling.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of both versions.")
    seed: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,
        description="Seeds the sampling: both versions answer a context with one seed, drawn from this and the "
        "context's messages, so they are compared on the same random draws and a rerun on the same versions and "
        "contexts gets the same replies (from an engine that honours `seed`, as vLLM does); null: unseeded.",
    )
    tolerance: float = Field(
        0.02, ge=0, description="The candidate's mean reward may be at most this much below the active one's."
    )
    promote: bool = Field(
        True, description="Promote a candidate that passes; false: only record the decision."
    )
    collapse_bounds: dict[str, float] = Field(
        default_factory=dict, description="Overrides of trainer.control.collapse.CollapseBounds fields."
    )
    request_timeout_s: float = Field(300.0, gt=0, description="Time allowed for one sampling request.")
    concurrency: int = Field(
        8, ge=1, description="Held-out contexts attempted at once (the engine batches their requests)."
    )

    _bounds = field_validator("collapse_bounds")(_known_bounds)

    def bounds(self) -> CollapseBounds:
        return CollapseBounds(**self.collapse_bounds)


# --- rollout


class RolloutConfig(_Section):
    """How a candidate that passed the gate reaches every call (see `trainer.control.canary`)."""

    canary_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the policy's calls a candidate that passed the gate serves as a canary before it is "
        "promoted or rolled back on live evidence; 0: promote at once.",
    )
    shadow_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Instead of a canary, the candidate answers copies of this share of calls in the shadow, "
        "never shown to users; the pairs are scored and decide the same way. Used when canary_share is 0.",
    )
    alpha: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Error rate of the always-valid test: a candidate worse than the baseline by more than margin "
        "is promoted with probability at most alpha/(2 - alpha), however long it is watched.",
    )
    margin: float = Field(
        0.02,
        ge=0,
        description="How much lower the candidate's mean reward may be and still count as no worse.",
    )
    tau: float = Field(
        0.1,
        gt=0,
        description="Scale of the differences the test expects (the spread of its normal mixture): near the true "
        "difference, decisions come soonest.",
    )
    min_episodes: int = Field(
        20,
        ge=2,
        description="Rewarded episodes (or scored shadow pairs) each version needs before any decision.",
    )
    min_calls: int = Field(
        20, ge=1, description="Answered calls each version needs before the health guards may roll back."
    )
    max_hours: float = Field(
        24.0, gt=0, description="A rollout still undecided after this long ends as `on_timeout` says."
    )
    on_timeout: Literal["rollback", "promote"] = Field(
        "rollback",
        description="What an undecided rollout does at max_hours: not shown no worse is not promoted.",
    )
    health_bounds: dict[str, float] = Field(
        default_factory=dict,
        description="Overrides of how much worse than the baseline's each health signal of the candidate may be "
        "(trainer.control.canary.HealthBounds): empty, repeated, refusal, error and tool-error shares, length.",
    )

    @field_validator("health_bounds")
    @classmethod
    def _known_health_bounds(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - HEALTH_BOUND_NAMES)
        if unknown:
            raise ValueError(
                f"unknown health bounds {unknown} (known: {', '.join(sorted(HEALTH_BOUND_NAMES))})"
            )
        return value

    def bounds(self) -> HealthBounds:
        return HealthBounds(**self.health_bounds)

    def trial(self) -> tuple[Literal["canary", "shadow"], float] | None:
        """How a candidate that passed the gate goes on trial, or None: promoted at once."""
        if self.canary_share > 0:
            return "canary", self.canary_share
        if self.shadow_share > 0:
            return "shadow", self.shadow_share
        return None

    @model_validator(mode="after")
    def _one_kind(self) -> RolloutConfig:
        if self.canary_share > 0 and self.shadow_share > 0:
            raise ValueError("set canary_share or shadow_share, not both")
        return self


# --- privacy

Detector = Literal["email", "phone", "card", "iban", "ip", "secret"]
ALL_DETECTORS: tuple[Detector, ...] = ("email", "phone", "card", "iban", "ip", "secret")
_HOOK = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class PrivacyConfig(_Section):
    """What is redacted from a call before it is stored (and so before it is exported, judged or trained on).

    `off` (the default) stores calls verbatim, as before this section existed: redaction changes training data
    and drops token ids, so it is a decision for whoever owns the policy, not something to switch on silently.
    """

    mode: Literal["off", "mask", "hash"] = Field(
        "off",
        description="`off`: store verbatim; `mask`: `[EMAIL]`; `hash`: `[EMAIL:1a2b3c4d]`, a keyed hash, so "
        "one value always gives one token (`KAIZEN_REDACTION_KEY`).",
    )
    detectors: list[Detector] = Field(
        default_factory=lambda: list(ALL_DETECTORS),
        description="Which built-in detectors run: `email`, `phone`, `card` (Luhn-checked), `iban` (mod-97 "
        "checked), `ip` (v4 and v6), `secret` (API keys, bearer tokens, PEM private keys).",
    )
    hook: str | None = Field(
        None,
        description="`package.module:function` taking and returning text, run after the built-in detectors.",
    )

    @field_validator("hook")
    @classmethod
    def _hook_path(cls, value: str | None) -> str | None:
        if value is not None and not _HOOK.match(value):
            raise ValueError("must be `package.module:function`")
        return value


# --- the whole configuration


class McpServerConfig(_Section):
    """An MCP server whose tools the policy may use: streamable HTTP at `url`, or a `command` Kaizen starts and
    talks to over stdio."""

    name: str = Field(
        description="What the server is called in logs, errors and the tool calls' records.",
        min_length=1,
        max_length=64,
    )
    url: str | None = Field(None, description="Streamable HTTP endpoint, e.g. `http://127.0.0.1:9000/mcp`.")
    command: list[str] | None = Field(None, description="argv of a server spoken to over stdio.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment of a stdio server.")
    cwd: str | None = Field(None, description="Working directory of a stdio server.")
    headers: dict[str, str] = Field(
        default_factory=dict, description="HTTP headers sent to a `url` server (e.g. its Authorization)."
    )
    timeout_s: float = Field(
        30.0, gt=0, description="Longest wait for the server to start, list or answer a call."
    )
    resample: bool = Field(
        False,
        description="Whether the trainer may call these tools when it rolls an episode out again (and the gate "
        "when it evaluates): only for tools without side effects. Off: the captured results of identical calls "
        "are replayed, and a rollout that makes another call is dropped.",
    )

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if bool(self.url) == bool(self.command):
            raise ValueError("give exactly one of `url` and `command`")
        return self


class FunctionToolConfig(_Section):
    """A Python function as a tool (`module:function`): its parameters' annotations are its JSON schema, the
    first paragraph of its docstring its description."""

    path: str = Field(description="`module:function`, importable where the gateway and the trainer run.")
    name: str | None = Field(None, description="The tool's name (default: the function's).")
    resample: bool = Field(
        True, description="Whether the trainer may call it while rolling episodes out again (see `servers`)."
    )

    @field_validator("path")
    @classmethod
    def _valid_path(cls, value: str) -> str:
        if not _HOOK.match(value):
            raise ValueError("expected `module:function`")
        return value


class ToolsConfig(_Section):
    """Tools Kaizen can run for the policy: offered to apps at `/mcp/<policy>`, and run by the trainer when it
    rolls agent episodes out again."""

    servers: list[McpServerConfig] = Field(default_factory=list, description="MCP servers.")
    functions: list[FunctionToolConfig] = Field(
        default_factory=list, description="Python functions; a plain string is taken as `path`."
    )
    timeout_s: float = Field(30.0, gt=0, description="Longest a Python function tool may take.")
    max_result_chars: int = Field(
        16_000, ge=1, description="A longer result is cut here (the agent is told so)."
    )

    @field_validator("functions", mode="before")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"path": item} if isinstance(item, str) else item for item in value]
        return value

    @model_validator(mode="after")
    def _unique_servers(self) -> ToolsConfig:
        names = [server.name for server in self.servers]
        if len(names) != len(set(names)):
            raise ValueError("two servers have the same name")
        return self


class PolicyConfig(_Section):
    """The whole configuration of a policy; `{}` means every default."""

    rewards: RewardConfig = Field(default_factory=RewardConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a configuration: where (`train.learning_rate`, `rewards.rule.kind`) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class InvalidPolicyConfig(ValueError):
    """A policy configuration with at least one problem; `problems` lists all of them."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
        super().__init__(f"invalid policy configuration ({count}): " + "; ".join(map(str, problems)))


def _problem(error: Any) -> ConfigProblem:
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    elif error["type"] == "value_error":
        message = str(error["ctx"]["error"])
    else:
        message = error["msg"]
    return ConfigProblem(path or "(the configuration)", message)


def load_policy_config(
    raw: Mapping[str, Any] | None, *, train_overrides: Mapping[str, Any] | None = None
) -> PolicyConfig:
    """Validate a stored or submitted configuration (absent or null sections take their defaults).

    `train_overrides` (e.g. `kaizen train --set`) replace keys of the `train` section for one run. Raises
    `InvalidPolicyConfig` naming every problem.
    """
    data: Any = raw  # anything but an object is left for pydantic to report
    if raw is None or isinstance(raw, Mapping):
        data = {k: v for k, v in (raw or {}).items() if not (v is None and k in PolicyConfig.model_fields)}
        train = data.get("train", {})
        if train_overrides and isinstance(train, Mapping):
            data["train"] = {**train, **train_overrides}
    try:
        return PolicyConfig.model_validate(data)
    except ValidationError as exc:
        raise InvalidPolicyConfig([_problem(error) for error in exc.errors()]) from exc
