"""One settings object for every Spool process, read from ``SPOOL_*`` environment variables.

A worker and an API started with the same variables find each other. Unknown ``SPOOL_*``
variables and invalid values fail at start with a message that names the variable.

Every setting is in the README's settings table. Running the processes: docs/operations.md.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.artifacts import check_url
from common.keys import Keys
from common.tool_calls import PARSERS
from common.webhooks import check_secret

DEFAULT_MAX_TOKENS = 128  # a request's max_tokens when it gives none (SPOOL_DEFAULT_MAX_TOKENS)

ENV_PREFIX = "SPOOL_"
_N = TypeVar("_N", int, float)
DEFAULT_SERVED_MODEL = "spool-default"  # the embedded default model's name (SPOOL_SERVED_MODEL_NAME)
TINY_EMBEDDING_MODEL = (
    "spool-tiny-embedding"  # the tiny embedding model's name (SPOOL_EMBEDDING, no SPOOL_MODEL)
)


class SettingsError(RuntimeError):
    """Raised at start when the environment holds an unknown or invalid SPOOL_* value."""


def model_name(model: str) -> str:
    """The name a model is served under: a hub id as given (``Qwen/Qwen2.5-0.5B-Instruct``), a
    directory by its own name (``/models/tiny-llama``: ``tiny-llama``).

    NOTE: clients take a path for a provider prefix (the OpenAI Agents SDK's ``Unknown prefix``),
    and a path tells other machines nothing. A relative path counts as one when it names a
    directory here, or starts with ``.`` or ``~``."""
    if not model:
        return model
    try:
        path = Path(model).expanduser()
        if path.is_absolute() or model.startswith((".", "~")) or path.is_dir():
            return Path(os.path.abspath(path)).name or model
    except (RuntimeError, ValueError, OSError):  # `~user` of no user, a NUL, a name too long
        pass
    return model


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    # Redis and naming
    redis_url: str = "redis://127.0.0.1:6379/0"  # the job data: jobs, logs, channels, heartbeats, batches
    # The broker's Redis, for Celery's queues and kombu's records (one message per job). It must
    # be a standalone Redis, since Celery's transport speaks no Redis Cluster. Empty means
    # SPOOL_REDIS_URL's (docs/operations.md "The broker apart").
    broker_url: str = ""
    redis_prefix: str = Field("spool", pattern=r"^[A-Za-z0-9_.-]+$")
    # The job data's buckets (common/keys.py): 1 on a standalone Redis (the names carry no hash
    # tag), CLUSTER_BUCKETS (24) on a Redis Cluster. Every API and worker of a deployment must use
    # the same: the first to start records it in Redis, and one that disagrees refuses to start.
    redis_buckets: int = Field(1, ge=1, le=1024)

    # Model and engine (worker)
    model: str = ""  # hub id or local path; empty: the embedded default model
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # The model's linear layers' weights: none (in SPOOL_DTYPE), or int8 (weight-only, one scale
    # per output channel, through torchao: the extra spool[int8]; EngineConfig.quantization).
    quantization: Literal["none", "int8"] = "none"
    max_batch_size: int = Field(32, ge=1, le=4096)
    max_model_len: int | None = Field(None, ge=16)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    prefill_chunk_size: int = Field(512, ge=16)
    max_prefill_tokens_per_step: int = Field(2048, ge=16)
    enable_prefix_caching: bool = True  # reuse cached prompt prefixes, per owner (the engine's EngineConfig)
    # The engine's forward compiled ahead of time, at load (EngineConfig.compile); unset: on for
    # SPOOL_DEVICE=cpu, where it pays (docs/benchmarks.md), falling back to eager if the compiler
    # fails on the model; off elsewhere (not measured on a GPU yet).
    compile: bool | None = None
    # Where compiled forwards are kept between starts (EngineConfig.compile_cache_dir); empty:
    # spool/compile under the user's cache directory ($XDG_CACHE_HOME, else ~/.cache).
    compile_cache_dir: str = ""
    # What one structured-output request's token mask may take per step (its grammar's allowed
    # tokens, while the whole batch waits), in ms of CPU time; a fill over it is cut off and its
    # request fails with guide_too_expensive (EngineConfig.max_guide_mask_ms). 0: no budget.
    max_guide_mask_ms: float = Field(50.0, ge=0)
    # The worker's torch threads (torch.set_num_threads); unset: torch's own default, a thread per
    # core. `spool up` sets it to the cores minus one, so the API and Redis beside it keep a core.
    torch_threads: int | None = Field(None, ge=1)
    # How tool calls are read from the output (common/tool_calls.py PARSERS) when the chat
    # template does not say (one that writes <tool_call> gets hermes); empty: tools are refused.
    tool_parser: str = ""
    # Embeddings (workers/engine/embedder.py): the worker's model embeds (/v1/embeddings) instead
    # of generating. A model saved in sentence-transformers' layout (modules.json) always does;
    # with SPOOL_MODEL unset, SPOOL_EMBEDDING=true embeds with the tiny embedding model.
    embedding: bool = False
    # How it pools (mean, cls or last), for a model whose files do not say; set, it also makes
    # the worker embed. Empty: the model's own (sentence-transformers' Pooling config).
    embedding_pooling: Literal["", "mean", "cls", "last"] = ""
    # Sizes a request's `dimensions` may truncate to (comma-separated, e.g. "256,128"): a
    # Matryoshka-trained model's. Empty: only the model's full size.
    embedding_dimensions: str = Field("", pattern=r"^\s*([0-9]+\s*(,\s*[0-9]+\s*)*)?$")

    # Media worker (image parts): one diffusers pipeline, loaded with DiffusionPipeline.from_pretrained
    image_model: str = ""  # hub id or directory; empty: a tiny random pipeline built on first use
    image_device: str = "cpu"
    image_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # The media worker's CPU niceness (os.nice at its start, so every thread has it): above 0 its
    # pipeline gives way to a text worker on the same CPUs. `spool up` sets it to 10.
    image_nice: int = Field(0, ge=0, le=19)
    # The API's setting. It is how long an image part's message waits at most, from its job's
    # creation, for the job's text parts to have their first token (or end), so that on shared
    # CPUs the image does not slow their prefill (common/store/lua/release_held.lua,
    # docs/operations.md "The image hold"). 0 means no wait. Media workers send the held parts
    # that are due, and this also bounds how long their check sleeps.
    image_hold_s: float = Field(2.0, ge=0)

    # Jobs (API)
    max_queued_jobs: int = Field(1000, ge=1)
    # With API keys, the most jobs one key may have queued, so one key's flood gets its own 429s
    # and leaves the rest of SPOOL_MAX_QUEUED_JOBS to the others; SPOOL_TENANT_MAX_QUEUED_JOBS
    # (TENANT=N,...) sets it for some keys.
    max_queued_jobs_per_key: int = Field(500, ge=1)
    tenant_max_queued_jobs: str = ""
    max_tokens_cap: int = Field(4096, ge=1)  # largest max_tokens a request may ask for
    default_max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1)
    job_ttl_s: int = Field(24 * 3600, ge=1)  # finished jobs expire after this
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_parts: int = Field(8, ge=1)  # parts per job
    max_n: int = Field(16, ge=1)  # choices (n) of one text request, each its own sequence in the batch
    # Prompts of one /v1/completions request (a list), times n: its choices (docs/openai.md).
    max_prompts: int = Field(64, ge=1)
    # Width x height of an image part. NOTE: 512x512 by default, the size whose denoising step a
    # CPU worker finishes well within SPOOL_ENGINE_STALL_S (the default pipeline's first step at
    # 1024x1024 ran past it, the watchdog ended the worker, and the next one took it: issue 33).
    # A GPU deployment raises it (docker-compose.yml: 1024x1024).
    max_image_pixels: int = Field(512 * 512, ge=64)
    max_image_steps: int = Field(100, ge=1)  # denoising steps of an image part
    # A guide's size in characters: a guided_regex, a guided_choice (all its strings) or a
    # response_format JSON schema (as compact JSON). Its grammar is compiled before the job runs,
    # in time that grows with it (a 29,000-character schema took 2.7 s, one of 116,000 170 s).
    max_guide_chars: int = Field(16_384, ge=1)
    detach_grace_s: float = Field(30.0, ge=0)
    sse_ping_s: float = Field(15.0, gt=0)
    api_keys: str = ""  # comma-separated; empty disables authentication (blank entries are refused)
    api_key: str = ""  # the key the client commands send (their --api-key's default); empty: none
    # Comma-separated origins whose pages may call the API (CORS), e.g. https://console.example;
    # "*" for any. Empty: none (the console at /console is same-origin and needs none).
    cors_origins: str = ""

    # Files and batches (API)
    max_file_bytes: int = Field(200_000_000, ge=1)  # an uploaded file's size at most
    batch_max_lines: int = Field(50_000, ge=1)  # lines of a batch input file at most
    # One API key's stored files (uploads and batch results; refused uploads answer 413) at most.
    max_file_bytes_per_key: int = Field(2_000_000_000, ge=1)
    max_files_per_key: int = Field(1000, ge=1)
    file_ttl_s: int = Field(30 * 24 * 3600, ge=1)  # files (and ended batches) expire after this
    # Lines of one batch queued or running at once (api/batch_feeder.py): enough to fill the
    # workers' batch slots between two feeds, few enough that a batch is never a flood of messages.
    batch_window: int = Field(256, ge=1)
    batch_feed_s: float = Field(0.2, gt=0)  # how often the feeder looks at the running batches
    # Where the bytes of files and images go (common/artifacts.py): empty, in Redis; file:///path,
    # a directory every API and worker process shares; s3://bucket/prefix, an S3-compatible
    # bucket (the extra spool[s3]). Redis keeps their metadata either way.
    artifact_url: str = ""

    # Workers (liveness)
    # A killed worker's jobs are taken over about max(lease_s, heartbeat_ttl_s) + heartbeat_s
    # after its last beat: another worker's sweep finds the lapsed lease (workers/reaper.py).
    heartbeat_s: float = Field(2.0, gt=0)
    heartbeat_ttl_s: float = Field(10.0, gt=0)
    lease_s: float = Field(20.0, gt=0)  # a running job whose lease lapses is taken over
    # A worker whose engine step runs longer than this exits (a hung kernel, a deadlock): its jobs'
    # leases lapse and other workers (or this one, restarted by its supervisor) take them over.
    engine_stall_s: float = Field(300.0, gt=0)
    # A worker told to stop (SIGTERM: Celery's warm shutdown) finishes its running jobs first;
    # while Redis stays unreachable this long it cannot, and it exits with status 75 instead
    # (workers/task_common.py StopBound): its jobs' leases lapse and other workers take them over.
    stop_timeout_s: float = Field(30.0, gt=0)
    # A job queued for a model that no live worker has served for this long (its workers left) is
    # moved to a live model's queue by a live text worker's sweep when its request named no model,
    # and failed with model_not_served when it named one (workers/reaper.py).
    unserved_grace_s: float = Field(600.0, gt=0)
    # Takes of a job (or part) at most: its first run and the takeovers after its worker died
    # (killed, or ended by the watchdog) or lost it; the next take fails it (too_many_attempts).
    max_attempts: int = Field(3, ge=1)
    worker_name: str = ""  # empty: spool-{hostname}-{pid}-{random} (workers/identity.py)
    # Fair shares between API keys (tenants) within a priority: the engine admits the waiting
    # request of the tenant with the least service (workers/engine/fairness.py), counted in
    # weighted tokens: prompt_weight per prompt token, output_weight per generated token.
    fair_share: bool = True  # off: first come, first served within a priority
    fair_prompt_weight: float = Field(1.0, ge=0)
    fair_output_weight: float = Field(2.0, gt=0)
    # Tenants' shares, as comma-separated TENANT=WEIGHT. TENANT is the short hash of the key
    # (``spool job`` and the metrics' `tenant` label show it). Unlisted tenants weigh 1.
    tenant_weights: str = ""
    # The lowest (most urgent) `priority` a request may give, unless its key's tenant is listed in
    # SPOOL_TENANT_PRIORITY_FLOORS (TENANT=FLOOR,...). A request below it gets a 403.
    priority_floor: int = 0
    tenant_priority_floors: str = ""
    # Each worker process serves its Prometheus metrics on this port (workers/metrics.py); unset: none.
    worker_metrics_port: int | None = Field(None, ge=1, le=65535)
    # Celery's task events and worker heartbeats (what Flower shows); `spool up` and compose turn them on.
    task_events: bool = False

    # Webhooks (docs/webhooks.md): signing, destinations, delivery by `spool worker --kind hooks`.
    # Comma-separated whsec_ secrets, the first one current; every one signs, for a rotation.
    # Unset, one is generated and kept in Redis. With API keys, each key signs with its own,
    # derived from them.
    webhook_secret: str = ""
    # Destinations that resolve to loopback, private, link-local or multicast addresses are
    # refused unless this is on, or their host is in webhook_allow_hosts (comma-separated).
    webhook_allow_private: bool = False
    webhook_allow_hosts: str = ""
    webhook_timeout_s: float = Field(10.0, gt=0)  # one attempt, connect to the answer's end
    webhook_backoff_s: float = Field(2.0, gt=0)  # the first retry's delay; doubled each time, jittered
    webhook_horizon_s: float = Field(24 * 3600.0, gt=0)  # retried until this long after the event
    webhook_max_bytes: int = Field(256 * 1024, ge=1024)  # a larger job is sent without its text
    # Attempts in flight per hook worker to one destination (scheme, host, port), and for one API key.
    webhook_max_per_host: int = Field(4, ge=1)
    webhook_max_per_key: int = Field(32, ge=1)
    webhook_sweep_s: float = Field(0.5, gt=0)  # how often a hook worker looks for due deliveries

    # API process
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # On SIGTERM `spool api` stops accepting, waits this long for open requests and streams to
    # end, then closes them: their clients resume on another replica (Last-Event-ID).
    shutdown_timeout_s: int = Field(5, ge=0)
    # Limits on what a client makes `spool api` read, before the app (api/http_limits.py).
    max_header_bytes: int = Field(32 * 1024, ge=1024)  # request line and headers: else 431
    header_timeout_s: float = Field(10.0, gt=0)  # a connection's request head: else 408
    body_timeout_s: float = Field(30.0, gt=0)  # a request's body, from its head on: else 408
    max_connections: int = Field(2048, ge=1)  # open connections (SSE streams too): else 503
    served_model_name: str = ""  # name in /v1/models; empty: derived from model

    @field_validator("device", "image_device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "cpu" and v != "mps" and not (v == "cuda" or v.startswith("cuda:")):
            raise ValueError("must be cpu, cuda, cuda:N or mps")
        return v

    @field_validator("artifact_url")
    @classmethod
    def _artifact_url(cls, v: str) -> str:
        check_url(v)  # ValueError: named with the variable
        return v

    @field_validator("webhook_secret")
    @classmethod
    def _webhook_secret(cls, v: str) -> str:
        for secret in (s.strip() for s in v.split(",") if v):
            check_secret(secret)  # ValueError: named with the variable
        return v

    @field_validator("tenant_weights")
    @classmethod
    def _tenant_weights(cls, v: str) -> str:
        parse_tenant_weights(v)
        return v

    @field_validator("tenant_priority_floors")
    @classmethod
    def _tenant_priority_floors(cls, v: str) -> str:
        parse_tenant_values(v, int)
        return v

    @field_validator("tenant_max_queued_jobs")
    @classmethod
    def _tenant_max_queued_jobs(cls, v: str) -> str:
        if any(n < 1 for n in parse_tenant_values(v, int).values()):
            raise ValueError("each TENANT=N must have N of 1 or more")
        return v

    @field_validator("tool_parser")
    @classmethod
    def _tool_parser(cls, v: str) -> str:
        if v and v not in PARSERS:
            raise ValueError(f"must be one of {', '.join(PARSERS)} (or empty)")
        return v

    @field_validator("api_keys")
    @classmethod
    def _api_keys(cls, v: str) -> str:
        # NOTE: " , " or "," would parse to no key at all and serve without authentication: a
        # value that is set but blank somewhere is a mistake, never a way to turn keys off.
        if v and any(not k.strip() for k in v.split(",")):
            raise ValueError("has a blank key; give comma-separated non-blank keys, or leave it unset")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        # A worker renews its heartbeat and leases every heartbeat_s; either lapsing between two
        # beats would make live workers look dead.
        for name in ("heartbeat_ttl_s", "lease_s"):
            if getattr(self, name) <= self.heartbeat_s:
                raise ValueError(f"{ENV_PREFIX}{name.upper()} must be longer than {ENV_PREFIX}HEARTBEAT_S")
        if self.max_prefill_tokens_per_step < self.prefill_chunk_size:
            raise ValueError(
                f"{ENV_PREFIX}MAX_PREFILL_TOKENS_PER_STEP must be at least {ENV_PREFIX}PREFILL_CHUNK_SIZE"
            )
        return self

    @property
    def keys(self) -> Keys:
        return Keys(self.redis_prefix, self.redis_buckets)

    @property
    def broker_redis_url(self) -> str:
        """The broker's Redis: SPOOL_BROKER_URL, else SPOOL_REDIS_URL."""
        return self.broker_url or self.redis_url

    @property
    def broker_apart(self) -> bool:
        """Whether the broker is another Redis than the job data's (common/store/outbox.py)."""
        return self.broker_redis_url != self.redis_url

    @property
    def served_model(self) -> str:
        """The model's name in /v1/models: a worker's, or the API's default while no worker is live."""
        if not self.served_model_name and not self.model and self.embedding:
            return TINY_EMBEDDING_MODEL
        return self.served_model_name or model_name(self.model) or DEFAULT_SERVED_MODEL

    @property
    def embedding_dimension_list(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.embedding_dimensions.split(",") if d.strip())

    @property
    def cors_origin_list(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    @property
    def webhook_allow_host_set(self) -> frozenset[str]:
        return frozenset(h.strip().lower() for h in self.webhook_allow_hosts.split(",") if h.strip())

    @property
    def tenant_weight_map(self) -> dict[str, float]:
        return parse_tenant_weights(self.tenant_weights)

    def priority_floor_of(self, tenant: str) -> int:
        """The lowest priority this tenant's requests may give."""
        return parse_tenant_values(self.tenant_priority_floors, int).get(tenant, self.priority_floor)

    def max_queued_of(self, tenant: str) -> int:
        """The most jobs this tenant (API key) may have queued."""
        return parse_tenant_values(self.tenant_max_queued_jobs, int).get(tenant, self.max_queued_jobs_per_key)

    @property
    def api_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())


def parse_tenant_values(v: str, cast: type[_N]) -> dict[str, _N]:
    """ "TENANT=VALUE,..." -> {tenant: value}; ValueError naming the item when malformed."""
    values = {}
    for item in filter(None, (x.strip() for x in v.split(","))):
        tenant, sep, value = item.partition("=")
        try:
            if not sep or not tenant.strip():
                raise ValueError
            values[tenant.strip()] = cast(value)
        except ValueError:
            raise ValueError(f"{item!r} is not TENANT={cast.__name__.upper()}") from None
    return values


def parse_tenant_weights(v: str) -> dict[str, float]:
    """SPOOL_TENANT_WEIGHTS -> {tenant: weight}; ValueError when malformed or not positive."""
    weights = parse_tenant_values(v, float)
    if bad := [t for t, w in weights.items() if not 0 < w < float("inf")]:
        raise ValueError(f"the weight of {bad[0]!r} must be positive")
    return weights


def check_api_settings(settings: Settings) -> None:
    """What an API process refuses besides the Settings' own checks (SettingsError)."""
    # NOTE: SPOOL_API_KEY (a client's key) is one letter from SPOOL_API_KEYS (the API's): an API
    # started with it alone would serve without authentication while its operator meant a key.
    if settings.api_key and not settings.api_keys:
        raise SettingsError(
            f"{ENV_PREFIX}API_KEY is set but {ENV_PREFIX}API_KEYS is not: {ENV_PREFIX}API_KEY is the key "
            f"the client commands send, the API's keys are {ENV_PREFIX}API_KEYS (set it, or unset "
            f"{ENV_PREFIX}API_KEY for this process)"
        )


def load_settings(**overrides: object) -> Settings:
    """Build Settings from the environment, failing with the names of the bad variables."""
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    unknown = sorted(k for k in os.environ if k.startswith(ENV_PREFIX) and k not in known)
    if unknown:
        raise SettingsError(f"unknown setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as e:
        problems = "; ".join(
            f"{ENV_PREFIX}{'.'.join(str(p) for p in err['loc']).upper()}: {err['msg']}"
            if err["loc"]
            else err["msg"].removeprefix("Value error, ")
            for err in e.errors()
        )
        raise SettingsError(f"invalid settings: {problems}") from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return load_settings()
