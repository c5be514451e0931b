"""Django settings for the FlexPipe console.

Everything a deployment changes comes from the environment, with embedded defaults that make
`make run` work on a bare machine: SQLite in the project folder, Redis at REDIS_URL.

    DATABASE_URL       default sqlite:///<project>/db.sqlite3   (PostgreSQL in production and tests; make run
                       uses .run/db-<engine>-<scenario>.sqlite3)
    REDIS_URL          default redis://127.0.0.1:6379/0          (Celery broker, Channels layer)
    SECRET_KEY         required when DEBUG is off (the development default is refused then)
    DEBUG              default 0 (make run sets 1 for the demo)
    FLEXPIPE_MAX_BODY_BYTES  request bodies over this are refused with a JSON 413 (2.5 MiB, Django's)
    ALLOWED_HOSTS      default *  (comma separated)
    FLEXPIPE_ENROLL_TOKEN          the join token agents enroll with (empty: enrollment closed)
    FLEXPIPE_REPORT_INTERVAL_S     how often agents report when nothing changes (15)
    FLEXPIPE_HEARTBEAT_TIMEOUT_S   a node that has not reported for this long is unschedulable (45)
    FLEXPIPE_TICK_S                period of the gearbox decision loop on Celery beat (15)
    FLEXPIPE_MAX_MODELS_PER_GPU    deployments that may share one GPU by memory fraction (2, seed 004 section 4.2;
                                   1: exclusive GPUs) - scheduler/pool/sharing.py
    FLEXPIPE_LOCAL_LOOP_S          period of each engine's local loop: admission, batch threshold (0.1)
    FLEXPIPE_GLOBAL_LOOP_S         period of the global correction on Celery beat: hints to the engines
                                   (0.5; 0: off). Warned about above 5x the local loop, refused at or
                                   above FLEXPIPE_TICK_S (console/gearbox/checks.py)
    FLEXPIPE_ROUTER_POLICY         flexpipe (the router's configured weights) or flexpipe+learned: per deployment,
                                   weights learnt by Hedge and rolled out against round-robin (console/gateway/learned.py)
    FLEXPIPE_ROUTER_ROLLOUT        JSON object of the rollout's fields (scheduler.router.learning.RolloutConfig:
                                   cold_start_s, window_s, shares, rollback_ratio, ...); checked at start-up
    FLEXPIPE_GATEWAY_TOKENIZERS    name=path,... tokenizers for deployments without a registry version (* for any)
    FLEXPIPE_PROCESS               what this web process serves (all): all - the console and the OpenAI API in one
                                   process (tests, one-process setups); console - the console without /v1, which
                                   answers 421 naming FLEXPIPE_GATEWAY_URL; gateway - only /v1, /healthz and
                                   /metrics (console.gateway.asgi sets it: the data plane's own process);
                                   agents - only /agent/v1, /healthz and /metrics (console.agent_asgi sets it:
                                   the agent API apart from the browsers' pages and sockets)
    FLEXPIPE_GATEWAY_URL           where clients reach the gateway process (the console's 421 names it)
    FLEXPIPE_GC_THRESHOLDS         the web, agents and gateway processes' garbage-collector thresholds (50000,20,100;
                                   python: Python's own): console/gctune.py says why
    FLEXPIPE_GC_FREEZE             freeze_s,sweep_s: freeze the tracked objects every freeze_s, collect all
                                   every sweep_s (1,300; off): console/gctune.py
    FLEXPIPE_MODEL_ROOTS           folders the registry may read local weights and tokenizers from
                                   (os.pathsep-separated; default .run/models)
    FLEXPIPE_SWEEP_S               period of the transition sweep on Celery beat: timeouts, dwells, and
                                   transitions whose worker died resume (2)
    FLEXPIPE_ALERTS_EVAL_S         period of the alert rules' evaluation on Celery beat (15)
    FLEXPIPE_CANARY_SHARE          share of new requests a new plan takes before the flip (0.1)
    FLEXPIPE_CANARY_DWELL_S        how long old and new plans serve side by side before the flip (2)
    FLEXPIPE_DRAIN_BUDGET_S        a sequence that ends on the old plan within this is left to finish (10)
    FLEXPIPE_PREPARE_TIMEOUT_S     prepare_plan (weights, comm groups, warm-up) may take this long (600)
    FLEXPIPE_STEP_TIMEOUT_S        freeze / thaw / abort may take this long (30)
    FLEXPIPE_MOVE_TIMEOUT_S        move_sequences may take this long plus twice its estimate (120)
    FLEXPIPE_RETRY_BACKOFF_S       wait before retrying a failed step (2)
    FLEXPIPE_LINK_MAX_AGE_S        a measured link older than this is aged out (1800)
    FLEXPIPE_INTRA_RACK_GBPS       assumed node-to-node bandwidth inside a rack without a measurement (25)
    FLEXPIPE_INTER_RACK_GBPS       ... across racks (10)
    FLEXPIPE_FRAGMENT_HORIZON_S    how far back the blocks' trajectories reach (14400)
    FLEXPIPE_POOL_MODEL_WEIGHTS    model=weight,... soft-limit weights of the shared pool (scheduler/pool/autoscale.py,
                                   the control loop's rule 14; default seed 004's example:
                                   Phi-3-mini=1.0,Llama-3-8B=2.3,Qwen2-72B=8.7; "" turns the soft limits off)
    FLEXPIPE_POOL_HIGH_TWU / FLEXPIPE_POOL_LOW_TWU / FLEXPIPE_POOL_SOFT_LIMIT_TWU
                                   the TWU scale rule's watermarks (0.85 / 0.4) and the pool TWU above which
                                   admission shares shrink (0.8)
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import dj_database_url
import plotly

BASE_DIR = Path(__file__).resolve().parent.parent


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


# Off unless asked for: `make run` sets DEBUG=1 for the demo (and says so); a deployment never should.
DEBUG = _env_bool("DEBUG", False)
DEV_SECRET_KEY = "dev-only-insecure-key-flexpipe"  # noqa: S105 - the demo's key, refused without DEBUG
SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY or SECRET_KEY == DEV_SECRET_KEY:
    if not DEBUG:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(
            "SECRET_KEY must be set, and not to the development default, when DEBUG is off: sessions and "
            "CSRF tokens are signed with it. Set SECRET_KEY (e.g. python -c 'import secrets; "
            "print(secrets.token_urlsafe(50))'), or DEBUG=1 for a demo on your own machine (make run does).")
    SECRET_KEY = DEV_SECRET_KEY
ALLOWED_HOSTS = [h.strip() for h in os.environ.get("ALLOWED_HOSTS", "*").split(",") if h.strip()]
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "console.accounts",
    "console.audit",
    "console.fleet",
    "console.registry",
    "console.gearbox",
    "console.dashboard",
    "console.gateway",
]

MIDDLEWARE = [
    "console.api.errors.JsonErrors",  # first: JSON errors on /api, /agent, /v1 whatever happens below
    "django.middleware.security.SecurityMiddleware",
    "console.static.WhiteNoise",  # WhiteNoise, async-capable (console/static.py)
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# Agent protocol v1's paths run behind this chain only (console/agent_http.py: the browser chain
# above costs an agent's request a dozen thread hops and gives it nothing it needs).
FLEXPIPE_AGENT_MIDDLEWARE = [
    "console.api.errors.JsonErrors",
    "console.agent_http.AgentWire",
]

# Which process this is (module docstring): the gateway's and the agent API's own processes route only their own URLs.
FLEXPIPE_PROCESS = os.environ.get("FLEXPIPE_PROCESS", "all").strip().lower()
_URLCONFS = {"all": "console.urls", "console": "console.urls", "gateway": "console.gateway.urls",
             "agents": "console.agent_urls"}
if FLEXPIPE_PROCESS not in _URLCONFS:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(f"FLEXPIPE_PROCESS: must be all, console, gateway or agents, got {FLEXPIPE_PROCESS!r}")
FLEXPIPE_GATEWAY_URL = os.environ.get("FLEXPIPE_GATEWAY_URL", "").strip().rstrip("/")
ROOT_URLCONF = _URLCONFS[FLEXPIPE_PROCESS]
WSGI_APPLICATION = "console.wsgi.application"
ASGI_APPLICATION = "console.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.dashboard.navigation.navigation",
            ],
        },
    },
]

# The gateway's process runs every query on console.db_pool's few threads (console/gateway/asgi.py):
# their connections are kept - at most FLEXPIPE_POLL_DB_THREADS, checked before reuse - rather than
# a new PostgreSQL connection for each of a request's half-dozen queries.
DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}"),
        conn_max_age=300 if FLEXPIPE_PROCESS == "gateway" else 0,
        conn_health_checks=FLEXPIPE_PROCESS == "gateway",
    )
}
# The test database's name is spelled out: the live-server test process (channels' daphne) derives
# it from NAME otherwise, after the test runner has already renamed NAME, and looks for test_test_*.
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes (web, worker, beat) share the file under `make run`: wait instead of failing.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
    # Take the write lock when a transaction begins: a read-then-write transaction would otherwise
    # fail at once with "database is locked" instead of waiting for the other writer.
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
    DATABASES["default"].setdefault("TEST", {})["NAME"] = str(BASE_DIR / ".run" / "test.sqlite3")
else:
    DATABASES["default"].setdefault("TEST", {})["NAME"] = f"test_{DATABASES['default']['NAME']}"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# One limit for every body (a prompt, a report, a registration); over it: 413 (console/api/errors.py).
DATA_UPLOAD_MAX_MEMORY_SIZE = int(os.environ.get("FLEXPIPE_MAX_BODY_BYTES", str(2_621_440)))

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
# plotly.js comes from the installed plotly wheel, served by us: pages never reach a CDN.
STATICFILES_DIRS = [
    BASE_DIR / "static",
    ("vendor/plotly", Path(plotly.__file__).resolve().parent / "package_data"),
]
# Serve from the app folders directly, so a `make run` needs no collectstatic step.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG
# ... so STATIC_ROOT (collectstatic's output) is optional: whitenoise need not warn that it is missing.
warnings.filterwarnings("ignore", message="No directory at: ", category=UserWarning)

LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")



def channel_layer(url: str, prefix: str) -> dict[str, object]:
    """The Channels layer over Redis at `url`.

    channels_redis waits for a consumer's next message with a blocking BZPOPMIN of
    `RedisChannelLayer.brpop_timeout` (5 s), while the redis client (5.x and later) gives every
    socket read a default timeout of 5 s: an idle websocket's read timed out first, the client
    raised "Timeout reading from ...", and the consumer died with the connection (close 1011,
    every 5-15 s; django/channels_redis#422, redis/redis-py#4091). The read timeout here outlasts
    the blocking pop by a margin, so the pop always answers (a message, or none) before it.
    """
    from channels_redis.core import RedisChannelLayer

    return {"BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [{"address": url,
                                  "socket_timeout": RedisChannelLayer.brpop_timeout + CHANNEL_READ_MARGIN_S,
                                  "socket_connect_timeout": 5}],
                       "prefix": prefix}}


CHANNEL_READ_MARGIN_S = 10.0
CHANNEL_LAYERS = {"default": channel_layer(REDIS_URL, os.environ.get("FLEXPIPE_CHANNEL_PREFIX", "flexpipe"))}
# Live pages: the server sends {"type": "ping"} this often, so an idle connection carries traffic
# (proxies keep it) and the page notices a dead one (static/js/live.js reconnects after 3 silent periods).
FLEXPIPE_WS_PING_S = float(os.environ.get("FLEXPIPE_WS_PING_S", "20"))
# A live socket sends a page's state at most once per this many seconds (console/dashboard/coalesce.py).
FLEXPIPE_PUSH_MIN_INTERVAL_S = float(os.environ.get("FLEXPIPE_PUSH_MIN_INTERVAL_S", "0.5"))
# The heatmap's first state goes in pages of this many nodes (8 GPUs each: ~300 KB, under daphne's 1 MiB).
# A live socket whose browser has not acknowledged this many bytes of messages is closed (4409) and
# the page re-syncs from a fresh snapshot (console/dashboard/consumers.py): a slow client never makes
# the server buffer without end. Larger than a whole first snapshot (1,000 nodes: ~3 MB).
FLEXPIPE_WS_MAX_UNACKED_BYTES = int(os.environ.get("FLEXPIPE_WS_MAX_UNACKED_BYTES", str(16 * 2**20)))
# The decision snapshot re-reads only the nodes whose rows changed (console/gearbox/snapshot.py), and
# everything at least this often (writes that bypass the actions); 0: every row each time.
FLEXPIPE_SNAPSHOT_CACHE_MAX_AGE_S = float(os.environ.get("FLEXPIPE_SNAPSHOT_CACHE_MAX_AGE_S", "60"))
FLEXPIPE_SNAPSHOT_PAGE_NODES = int(os.environ.get("FLEXPIPE_SNAPSHOT_PAGE_NODES", "100"))

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", REDIS_URL)
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("FLEXPIPE_QUEUE", "flexpipe")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# A request path that sends a task never waits long on a broker that is away (console.celery.enqueue):
# a short publish retry and bounded sockets (redis-py waits forever by default).
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.25, "interval_max": 0.5}
CELERY_BROKER_TRANSPORT_OPTIONS = {"socket_connect_timeout": 2, "socket_timeout": 10}
CELERY_REDIS_SOCKET_CONNECT_TIMEOUT = 2

# The cluster's join token: an agent presents it once to enroll and receives its own token.
# Empty = enrollment closed (agents then need a token issued with `manage.py issue_agent_token`).
FLEXPIPE_ENROLL_TOKEN = os.environ.get("FLEXPIPE_ENROLL_TOKEN", "")
FLEXPIPE_REPORT_INTERVAL_S = float(os.environ.get("FLEXPIPE_REPORT_INTERVAL_S", "15"))
FLEXPIPE_HEARTBEAT_TIMEOUT_S = float(os.environ.get("FLEXPIPE_HEARTBEAT_TIMEOUT_S", "45"))
FLEXPIPE_TICK_S = float(os.environ.get("FLEXPIPE_TICK_S", "15"))
# How many deployments may share one GPU by memory fraction (seed 004 section 4.2: max_models_per_gpu: 2)
FLEXPIPE_MAX_MODELS_PER_GPU = int(os.environ.get("FLEXPIPE_MAX_MODELS_PER_GPU", "2"))
# The two time scales under the gears (scheduler/control/correction.py; seed 003: 100 ms and 500 ms)
FLEXPIPE_LOCAL_LOOP_S = float(os.environ.get("FLEXPIPE_LOCAL_LOOP_S", "0.1"))
FLEXPIPE_GLOBAL_LOOP_S = float(os.environ.get("FLEXPIPE_GLOBAL_LOOP_S", "0.5"))
# Topology events within this window share one tick (console/gearbox/coalesce.py); a pending mark
# whose task was lost expires after FLEXPIPE_TICK_PENDING_TTL_S (default: the beat period).
FLEXPIPE_TICK_COALESCE_S = float(os.environ.get("FLEXPIPE_TICK_COALESCE_S", "0.5"))
# Threads the long polls' short queries borrow (console/db_pool.py): at most this many PostgreSQL
# connections for all pending polls of a process together. The gateway's process runs every request's
# queries on them (console.gateway.asgi): its open streams hold no connection either.
FLEXPIPE_POLL_DB_THREADS = int(os.environ.get("FLEXPIPE_POLL_DB_THREADS", "4"))
# The web and gateway processes' garbage-collector thresholds (console/gctune.py: measured there);
# "python": Python's own.
FLEXPIPE_GC_THRESHOLDS = os.environ.get("FLEXPIPE_GC_THRESHOLDS", "50000,20,100")
# Freeze what survives every 1 s, unfreeze and collect all every 300 s (console/gctune.py); "off".
FLEXPIPE_GC_FREEZE = os.environ.get("FLEXPIPE_GC_FREEZE", "1,300")
FLEXPIPE_TICK_PENDING_TTL_S = float(os.environ.get("FLEXPIPE_TICK_PENDING_TTL_S", str(FLEXPIPE_TICK_S)))
# Local weights files up to this size are hashed during the registration request; bigger ones by the
# Celery task registry.verify_weights (the version says `verifying` meanwhile). ~0.1 s per 64 MiB.
FLEXPIPE_REGISTRY_SYNC_VERIFY_BYTES = int(os.environ.get("FLEXPIPE_REGISTRY_SYNC_VERIFY_BYTES", str(64 * 2**20)))
# Where the console may read model files (weights it hashes, tokenizers it loads): a registration
# naming a local file anywhere else is refused (a 400 naming weights_uri or tokenizer). os.pathsep-separated.
FLEXPIPE_MODEL_ROOTS = [Path(p) for p in os.environ.get("FLEXPIPE_MODEL_ROOTS", str(BASE_DIR / ".run" / "models"))
                        .split(os.pathsep) if p.strip()]
FLEXPIPE_SWEEP_S = float(os.environ.get("FLEXPIPE_SWEEP_S", "2"))
FLEXPIPE_ALERTS_EVAL_S = float(os.environ.get("FLEXPIPE_ALERTS_EVAL_S", "15"))
# The gateway's CPU pool (console/gateway/cpu.py): threads, and requests working or waiting for one
# before a 429 (a process that takes bursts of a hundred arrivals needs a longer queue than 16).
FLEXPIPE_GATEWAY_CPU_THREADS = int(os.environ.get("FLEXPIPE_GATEWAY_CPU_THREADS", "2"))
FLEXPIPE_GATEWAY_CPU_QUEUE = int(os.environ.get("FLEXPIPE_GATEWAY_CPU_QUEUE", "16"))
# Learned routing (console/gateway/learned.py): the policy's name and the rollout's fields (JSON), checked at start-up.
FLEXPIPE_ROUTER_POLICY = os.environ.get("FLEXPIPE_ROUTER_POLICY", "flexpipe").strip() or "flexpipe"
FLEXPIPE_ROUTER_ROLLOUT = os.environ.get("FLEXPIPE_ROUTER_ROLLOUT", "").strip() or None
# How long an admission waits for the table that ends a switch's freeze before a 429 (console/gateway/views.py).
FLEXPIPE_GATEWAY_FROZEN_WAIT_S = float(os.environ.get("FLEXPIPE_GATEWAY_FROZEN_WAIT_S", "3"))
# How long the gateway holds a request of a deployment scaled to zero while its gear comes back up (a cold
# start: the weights load, from the host cache or from disk) before a 503 (console/gateway/views.py).
FLEXPIPE_GATEWAY_COLD_START_WAIT_S = float(os.environ.get("FLEXPIPE_GATEWAY_COLD_START_WAIT_S", "120"))
# The gateway's tokenizer for a deployment that serves no registry version: "name=path,..." by deployment
# or model name, "*" for any (make run's simulated fleet: its locally made demo tokenizer).
FLEXPIPE_GATEWAY_TOKENIZERS = dict(item.split("=", 1) for item in os.environ.get("FLEXPIPE_GATEWAY_TOKENIZERS", "")
                                   .split(",") if "=" in item)
# The shared pool (scheduler/pool/autoscale.py): the TWU scale rule's watermarks (seed 004 §3.2: scale out above
# 0.85, in below 0.4) and the per-model soft limits - weights that shrink a heavy model's admission share when
# the pool's TWU is over the soft limit, rather than rejecting it (the seed's example weights by default).


def _model_weights(raw: str) -> dict[str, float]:
    """"model=weight,..." -> {model: weight}; "" -> {} (no soft limits). A bad item stops the start, named."""
    from django.core.exceptions import ImproperlyConfigured

    from scheduler.pool.autoscale import parse_weights

    try:
        return parse_weights(raw, "FLEXPIPE_POOL_MODEL_WEIGHTS")
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None


# The control loop's rule 14 reads them (console/gearbox/control.loop_config); "" turns the soft limits off.
FLEXPIPE_POOL_MODEL_WEIGHTS = _model_weights(
    os.environ.get("FLEXPIPE_POOL_MODEL_WEIGHTS", "Phi-3-mini=1.0,Llama-3-8B=2.3,Qwen2-72B=8.7"))
FLEXPIPE_POOL_SCALE = {
    "high_watermark": float(os.environ.get("FLEXPIPE_POOL_HIGH_TWU", "0.85")),
    "low_watermark": float(os.environ.get("FLEXPIPE_POOL_LOW_TWU", "0.4")),
    "soft_limit_twu": float(os.environ.get("FLEXPIPE_POOL_SOFT_LIMIT_TWU", "0.8")),
}  # scheduler.pool.autoscale.ScaleConfig.from_dict(FLEXPIPE_POOL_SCALE) checks it
FLEXPIPE_CANARY_SHARE = float(os.environ.get("FLEXPIPE_CANARY_SHARE", "0.1"))
FLEXPIPE_CANARY_DWELL_S = float(os.environ.get("FLEXPIPE_CANARY_DWELL_S", "2"))
FLEXPIPE_DRAIN_BUDGET_S = float(os.environ.get("FLEXPIPE_DRAIN_BUDGET_S", "10"))
FLEXPIPE_PREPARE_TIMEOUT_S = float(os.environ.get("FLEXPIPE_PREPARE_TIMEOUT_S", "600"))
FLEXPIPE_STEP_TIMEOUT_S = float(os.environ.get("FLEXPIPE_STEP_TIMEOUT_S", "30"))
FLEXPIPE_MOVE_TIMEOUT_S = float(os.environ.get("FLEXPIPE_MOVE_TIMEOUT_S", "120"))
FLEXPIPE_RETRY_BACKOFF_S = float(os.environ.get("FLEXPIPE_RETRY_BACKOFF_S", "2"))
# How many reports per GPU the bounded history keeps (at 15 s per report: ~1 hour), and none older
# than the age below; the beat task fleet.prune_history applies it every FLEXPIPE_PRUNE_S
# (console/fleet/retention.py).
FLEXPIPE_GPU_HISTORY = int(os.environ.get("FLEXPIPE_GPU_HISTORY", "240"))
FLEXPIPE_GPU_HISTORY_MAX_AGE_S = float(os.environ.get("FLEXPIPE_GPU_HISTORY_MAX_AGE_S", "86400"))
FLEXPIPE_PRUNE_S = float(os.environ.get("FLEXPIPE_PRUNE_S", "300"))
# A task's result (the beat's ticks and sweeps keep theirs; what enqueue sends keeps none) expires in
# Redis after this many seconds (Celery's own default: a day).
CELERY_RESULT_EXPIRES = int(os.environ.get("FLEXPIPE_RESULT_EXPIRES_S", "3600"))
# Links (console/fleet/links.py): a measured figure older than this is no longer used (agents
# re-measure every FLEXPIPE_LINK_PROBE_S, 600 s by default); without one the planner assumes the
# rack default below (the Overview marks it "assumed"). The defaults stay under the planner's
# bar for PP and prefill/decode splits (100 Gb/s): only a measured link builds a cross-node plan,
# an assumed one only prices moves.
FLEXPIPE_LINK_MAX_AGE_S = float(os.environ.get("FLEXPIPE_LINK_MAX_AGE_S", "1800"))
FLEXPIPE_INTRA_RACK_GBPS = float(os.environ.get("FLEXPIPE_INTRA_RACK_GBPS", "25"))
FLEXPIPE_INTER_RACK_GBPS = float(os.environ.get("FLEXPIPE_INTER_RACK_GBPS", "10"))
# The fragment history every decision reads (scheduler.topology.FragmentHistory): how far back
# each block's trajectory reaches.
FLEXPIPE_FRAGMENT_HORIZON_S = float(os.environ.get("FLEXPIPE_FRAGMENT_HORIZON_S", str(4 * 3600)))

CELERY_BEAT_SCHEDULE = {
    "fleet-heartbeat-sweep": {
        "task": "fleet.sweep_heartbeats",
        "schedule": max(1.0, FLEXPIPE_HEARTBEAT_TIMEOUT_S / 3),
    },
    # the gearbox decides on this period, and at once on topology events (console/gearbox/receivers.py)
    "gearbox-tick": {
        "task": "gearbox.tick",
        "schedule": max(1.0, FLEXPIPE_TICK_S),
        "kwargs": {"trigger": "periodic"},
    },
    # the GPU samples' retention policy (console/fleet/retention.py)
    "fleet-prune-history": {
        "task": "fleet.prune_history",
        "schedule": max(10.0, FLEXPIPE_PRUNE_S),
    },
    # transitions advance on every ack; this catches timeouts, dwells and workers that died
    "transitions-sweep": {
        "task": "transitions.sweep",
        "schedule": max(0.5, FLEXPIPE_SWEEP_S),
    },
    # the global correction: hints to the engines (console/gearbox/correction.py); 0: off
    **({"gearbox-correct": {"task": "gearbox.correct", "schedule": FLEXPIPE_GLOBAL_LOOP_S,
                            "options": {"expires": 2 * FLEXPIPE_GLOBAL_LOOP_S}}}
       if FLEXPIPE_GLOBAL_LOOP_S > 0 else {}),
    # the alert rules over the console's metrics: their "since" counts from here (console/metrics/alerts.py)
    "alerts-evaluate": {
        "task": "metrics.evaluate_alerts",
        "schedule": max(1.0, FLEXPIPE_ALERTS_EVAL_S),
    },
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "console.accounts.auth.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",  # the browser: CSRF enforced on writes
    ],
    "DEFAULT_PERMISSION_CLASSES": ["console.accounts.auth.IsViewer"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "console.api.pagination.StrictLimitOffsetPagination",
    # JSON both ways: Swagger UI at /api/docs/ is the interactive view, and a form-encoded body could not
    # carry `architecture` (an object) anyway.
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["console.api.parsers.BoundedJSONParser"],
}

SPECTACULAR_SETTINGS = {
    "TITLE": "FlexPipe API",
    "DESCRIPTION": "Control plane for LLM inference on fragmented GPU clusters",
    "VERSION": "1",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": r"/api/v1",
    # every operation's 400/401/403/404 and their bodies; request bodies refuse unknown keys
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "console.api.openapi.document_errors"],
    # The schema is public (it holds no data) so tools and the Swagger page can load it; every
    # operation in it still needs a token or a session with the right role.
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    # Several choice fields are called `mode`: name each set of choices after what it is.
    "ENUM_NAME_OVERRIDES": {
        "DeploymentModeEnum": ["auto", "advisory", "pinned", "emergency"],
        "SetModeEnum": ["auto", "advisory", "pinned"],
        "UnpinModeEnum": ["auto", "advisory"],
        "PlanModeEnum": ["colocated", "disaggregated"],
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}},
}
