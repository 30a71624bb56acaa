"""Typed configuration: one TOML file holds every section; environment variables
(``OMRL_<SECTION>__<FIELD>``) and ``--set section.field=value`` override it, in that order.

Bad config fails at start with the field's dotted name and what to change.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_PREFIX = "OMRL_"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class RedisConfig(Section):
    url: str | None = None
    """Redis URL: redis://[user:password@]host:port/db, or rediss:// for TLS; unset means
    `omrl run` starts an embedded server."""
    run: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$")
    """Run name: every key of the run lives under the hash tag {run}."""
    cluster: bool = False
    """Connect to a Redis Cluster (redis.url names any one node)."""
    shards: int = Field(1, ge=1, le=1024)
    """Rollout streams; each has its own hash tag, so on a cluster they spread over nodes."""
    tls_ca_file: str | None = None
    """CA bundle to verify the server's certificate (rediss:// URLs)."""
    tls_cert_file: str | None = None
    """Client certificate, for servers that require one (rediss:// URLs)."""
    tls_key_file: str | None = None
    """Key of the client certificate."""
    max_stream_len: int = Field(16, ge=1)
    """Back-pressure: producers wait while a rollouts stream holds this many groups
    (delivered-but-unacknowledged ones included)."""
    producer_buffer: int = Field(64, ge=1)
    """Groups an actor buffers locally while Redis is unreachable before it stops producing."""
    retry_attempts: int = Field(60, ge=1)
    """Attempts of a Redis command that failed on a connection fault before the process fails."""
    claim_idle_s: float = Field(60.0, gt=0)
    """The janitor reclaims entries pending longer than this from consumers that died."""
    max_deliveries: int = Field(5, ge=1)
    """An entry delivered more often than this goes to the dead letters (reason max_deliveries)."""
    janitor_every_s: float = Field(5.0, gt=0)
    """How often the learner's janitor runs."""
    consumer_gone_s: float = Field(600.0, gt=0)
    """Consumers idle this long with nothing pending are removed from the group."""
    dead_after_s: float = Field(15.0, gt=0)
    """A member whose last heartbeat is older than this is reported dead."""
    embedded_aof: Literal["everysec", "always", "off"] = "everysec"
    """`omrl run`'s embedded server keeps what it holds in an append-only file in RUN_DIR/redis and
    reads it back when it is restarted. everysec: a write reaches the file before its reply and is
    fsynced within a second, except while the last fsync still runs (Redis then answers first, for up
    to 2 s): a killed redis-server loses nothing outside that window, a crash of the machine the last
    second or two. always: fsync before every reply (nothing lost even then; every write waits for
    the disk). off: nothing on disk; a restart loses every group it held. true/false mean
    always/off. Weight versions go to RUN_DIR/weights, not into Redis (weights.dir)."""

    @field_validator("embedded_aof", mode="before")
    @classmethod
    def _aof_from_bool(cls, value: Any) -> Any:
        return {True: "always", False: "off"}.get(value, value) if isinstance(value, bool) else value
    ticket_ttl_s: float = Field(60.0, gt=0)
    """An admission ticket whose actor sent no heartbeat for this long comes back (actor presumed dead)."""
    dead_letter_max: int = Field(10_000, ge=1)
    """The dead-letter stream keeps about this many newest entries (counts by reason are kept whole)."""


class ModelConfig(Section):
    path: str | None = None
    """Hugging Face causal LM (a local path or a hub id); unset means build the tiny model in RUN_DIR/model."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype for vLLM and of the weights the learner publishes (it trains on fp32 copies)."""


class EnvSpecConfig(Section):
    """How to talk to an env's server, where it differs from what envs/specs.py knows of the env
    (unset fields: the known spec's value, or for an env it does not know the "id" family's)."""

    task_field: str | None = None
    """The /reset field that names the task (AgentGym: data_idx; alfworld: game; webshop: session_id)."""
    reset_extra: dict[str, Any] | None = None
    """Fixed extra /reset fields (alfworld: {world_type = "Text"})."""
    create_body: dict[str, Any] | None = None
    """JSON body of /create, for servers that want one (textcraft: {})."""
    reward_field: str | None = None
    """The answer field that holds the reward (AgentGym: reward; babyai, sciworld: score)."""
    reward_scale: float | None = Field(None, gt=0)
    """Multiplies the reward field (sciworld's score runs 0-100: 0.01)."""
    reward_is_total: bool | None = None
    """The reward field is the episode's running total, not this step's increment."""
    success: Literal["field", "done", "full_reward"] | None = None
    """What counts as success. field: the answer's `success` (else full_reward); done: the episode
    ended done; full_reward: the rewards sum to 1 (after scaling)."""
    reset_prefix: str | None = None
    """A /reset answer field put before the first observation, with a line break (sciworld: task_description)."""
    clean_action: bool | None = None
    """Keep only letters, digits, commas and spaces of an action, as AgentGym's babyai and textcraft clients do."""
    refused: str | None = None
    """A regular expression an observation matches from its start when the env refused the action before it
    (textcraft: "Could not "): the actor records such turns (learner.refused_turns)."""
    num_tasks: int | None = Field(None, ge=2)
    """Task indices are 0..num_tasks-1 (unset: the known spec's count, else env.num_tasks)."""
    test_from: int | None = Field(None, ge=1)
    """Indices from this one on are held out for evaluation (unset: the known spec's, else the last tenth)."""


class EnvConfig(Section):
    name: str = "letters"
    """The env: a built-in one served by `omrl env-server`, or the name of an AgentGym server at env.url
    (babyai, textcraft, sciworld, alfworld, webshop, ...: see envs/specs.py)."""
    url: str | None = None
    """Base URL of the env server; unset means http://{host}:{port} (`omrl run` starts one)."""
    protocol: Literal["id", "env_idx"] | None = None
    """AgentGym protocol family of the server; unset means the env's own (envs/specs.py), else id."""
    tasks: str | None = None
    """Task files (a directory with train.parquet and test.parquet, see `omrl tasks make`); unset means
    the env's index range, split as envs/specs.py says."""
    host: str = "127.0.0.1"
    """Host the env server binds to."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the env server (0: `omrl run` picks a free one)."""
    workers: int = Field(1, ge=1, le=256)
    """Processes of `omrl env-server` behind env.port, each instance pinned to one (envs/workers.py): more
    cores for envs whose calls hold the GIL (babyai). Worker i listens on env.port + 1 + i (publish those
    too where clients are outside the container); envs that release the GIL scale with threads in one."""
    num_tasks: int = Field(1000, ge=2)
    """Tasks are integers 0..num_tasks-1 (AgentGym `data_idx`), for envs whose spec does not say."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Env-specific options passed to the env constructor (letters: turns, alphabet; textcraft: shuffle_names,
    the share of tasks in worlds of their own item names; progress, what its step answers' `progress` counts,
    items or crafts); the start's checks make the env once with them."""
    timeout_s: float = Field(120.0, gt=0)
    """One env request may take this long; past it the episode's group fails (reason env_timeout)."""
    reuse_instances: bool = True
    """An episode's env instance, when the episode ended without an error, is reset to the client's next
    task instead of closed (two HTTP round trips an episode fewer, as AgentGym's clients do); false: a
    new instance an episode, closed at its end."""
    spec: EnvSpecConfig = Field(default_factory=EnvSpecConfig)
    """The server's fields and rules where they differ from the known env's (envs/specs.py)."""

    @property
    def base_url(self) -> str:
        return self.url or f"http://{self.host}:{self.port}"


class ActorConfig(Section):
    num_actors: int = Field(2, ge=1)
    """Actor processes `omrl run` starts."""
    group_size: int = Field(8, ge=2)
    """G: episodes per task, pushed as one group (GRPO needs at least 2)."""
    concurrent_groups: int = Field(8, ge=1)
    """Groups one actor runs at once."""
    task_sampling: Literal["uniform", "spread"] = "uniform"
    """Which train task a group plays (actors/sampling.py): uniform, every one alike; spread, a pool of
    tasks (task_pool) whose every group this actor played had all its episodes' rewards alike (no
    signal for a group-relative estimator) drawn spread_floor times as often as the others. With
    learner.filter_groups the groups without signal are then fewer to play and drop. Unmeasured on a
    learning result (TextCraft page, Next)."""
    task_pool: str | None = None
    """task_sampling = "spread": a column of the task files whose value pools tasks (TextCraft's demo
    writes `goal`: a goal's variants are one pool); unset, each task is its own."""
    spread_floor: float = Field(0.1, gt=0, le=1)
    """task_sampling = "spread": the weight of a pool whose groups so far all had no spread (the
    others weigh 1)."""
    max_tokens: int = Field(4, ge=1)
    """Tokens generated per turn at most."""
    max_turns: int = Field(4, ge=1)
    """Turns per episode at most (the env may end it sooner)."""
    max_seq_len: int = Field(256, ge=16)
    """Context window of one episode in tokens; the episode ends when it is full."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy)."""
    stop: list[str] = Field(default_factory=lambda: ["\n"])
    """Strings that end a turn's generation, matched on its decoded text (a "\\n" inside a token such
    as ".\\n" ends it too); the tokens stay in the buffer as sampled, up to the one that completes it."""
    system_prompt: str = ""
    """Text placed before the first observation."""
    action_template: str = "raw"
    """How the model writes an action: raw, react, tag or json (actors/templates.py)."""
    constrain_actions: bool = False
    """The model's turn is one of the actions the env admits now (its `/actions`, envs/base.py
    `Env.actions`): vLLM masks every token that leaves them, so no turn is malformed or made up. Each
    sample carries what the mask let through at each token (Sample.allowed) and the learner scores
    that same masked distribution (learner/scoring.py `masked_logprobs`), as the behaviour log-probs
    are. Needs action_template "raw", an env that lists its actions, and, with learner.parallel fsdp2
    on several ranks, learner.vocab_parallel = false; the episode loop only (the config refuses it
    with actor.agent or agent_url, whose calls are not masked)."""
    chat_template: Literal["auto", "none"] = "auto"
    """auto: render turns with the tokenizer's chat template when it has one (actors/chat.py); none:
    plain text, the system text and each observation as they come."""
    rewards: dict[str, float] = Field(default_factory=lambda: {"env": 1.0})
    """Reward functions by name and their weights (envs/rewards.py): env, success, format, process, length,
    or one a module in run.plugins registers."""
    reward_timeout_s: float = Field(60.0, gt=0)
    """An async reward function (an LLM judge, a verifier) may take this long per episode; past it the
    episode's group fails (reason reward_timeout)."""
    cpus: list[int] = Field(default_factory=list)
    """CPU cores an actor process and its engine run on (empty: any). On one machine, cores of
    their own for the actors and for the learner stand in for devices of their own."""
    kv_cache_mb: int | None = Field(None, ge=1)
    """KV-cache memory of one actor's vLLM engine in MiB (unset: 64 on CPU; on a GPU, what
    actor.gpu_memory_utilization leaves)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Share of a GPU's memory one engine takes (weights, activations and KV cache)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one engine shards the model over."""
    max_model_len: int | None = Field(None, ge=16)
    """The engine's context length (unset: actor.max_seq_len)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prefixes (a group's episodes share their prompt); emptied at every
    weight update but a kept one (its requests hold blocks), and never shared across an update."""
    enforce_eager: bool | None = None
    """Run without CUDA graphs (unset: only on CPU, where there are none)."""
    update_mode: Literal["interrupt", "drain", "keep"] = "interrupt"
    """How a weight update meets running requests. interrupt: generation pauses between decode steps,
    the update is applied, and each request continues with its tokens kept (those after carry the new
    version; its context is computed again on the new weights); keep: the same pause, but running
    requests stay in the engine with their KV cache of the old weights and go on (no recomputation;
    tokens after carry the new version, sampled over the old KV, as PipelineRL does); drain: new
    requests wait while running ones finish, then the update is applied."""
    seed: int = 0
    """Base seed; actor i uses seed + i (a restarted process mixes in how often its name started).
    An actor started with no --index (a scaled replica) gets the lowest free index from Redis."""
    gpu_by_index: bool = False
    """With several GPUs visible, this actor's vLLM uses one: visible GPU (learner.ranks + index) mod
    count, so the replicas of a scaled service on one host spread over the GPUs the learner leaves."""
    weight_poll_s: float = Field(0.2, gt=0)
    """An actor applies a new weight version when it is announced, and checks for one this often
    besides (a lost announcement costs one check)."""
    heartbeat_s: float = Field(2.0, gt=0)
    """How often an actor sends a heartbeat."""
    metrics_s: float = Field(1.0, gt=0)
    """How often an actor appends its counters to RUN_DIR/actors/NAME.jsonl."""
    drain_s: float = Field(5.0, ge=0)
    """On stop, how long groups in flight may run before they are cancelled (reason cancelled)."""
    flush_s: float = Field(5.0, ge=0)
    """On stop, how long finished groups may take to reach Redis, after the drain."""
    agent: str | None = None
    """Your own agent plays the episodes (docs/guides/agents.md): "module:function" or
    "path/to/file.py:function" (relative to where omrl runs), an `async def
    rollout(task, client)` given the task (a dict: task_id, env, env_url, data) and an
    openai.AsyncOpenAI client on this actor's endpoint, returning its reward (or None, having posted
    rewards to the session). Unset, with agent_url unset too: the actor's own episode loop."""
    agent_url: str | None = None
    """Your agent as an HTTP service in any language: for each episode the actor POSTs {"task",
    "base_url", "session"} to this URL and takes the reward from the answer's {"reward": ...}."""
    agent_timeout_s: float = Field(600.0, gt=0)
    """One agent episode may take this long; past it the group fails (reason agent_timeout)."""
    @property
    def agent_name(self) -> str | None:
        """Your agent as the config names it (actor.agent or agent_url); None: the episode loop plays."""
        return self.agent or self.agent_url or None

    gateway_host: str = "127.0.0.1"
    """Host the actor's OpenAI-compatible endpoint binds to (served when actor.agent or agent_url is set)."""
    gateway_port: int = Field(0, ge=0, le=65535)
    """Its port (0: a free one, which the actor's log names). A fixed port suits one actor a host (a
    container); `omrl run` starts several on one host: leave it 0. The evaluator's is always free."""
    gateway_url: str | None = None
    """The endpoint's URL as agents reach it (unset: http://{gateway_host}:{port}); set it where an
    agent service runs elsewhere (compose: http://actor:PORT)."""


CRITIC_ALGORITHMS = ("ppo",)
"""learner.algorithm values whose advantages come from the critic (GAE or V-trace), in the trainer."""
GROUP_RELATIVE = ("grpo", "drgrpo", "rloo", "gigpo")
"""learner.algorithm values whose advantages are relative to their group's rewards: a group of equal
rewards carries no signal (learner/algorithms.py registers each with its kind; a test keeps the two
lists the same)."""


class LearnerConfig(Section):
    mode: Literal["async", "sync"] = "async"
    """async: actors generate while the learner trains, up to learner.eta optimizer steps ahead; sync:
    the synchronous baseline: generate a batch with the current weights, train, publish, and only
    then generate again (eta is not used; staleness is 0 with publish_every 1, at most
    publish_every - 1 steps otherwise)."""
    steps: int = Field(160, ge=1)
    """Optimizer steps to run, then exit."""
    groups_per_step: int = Field(8, ge=1)
    """B: groups in one optimizer step."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: a group without signal (every episode's reward alike, so a
    group-relative estimator gives it no advantage) is acknowledged untrained and counted as
    `filtered:no_signal` (`omrl status`); its admission ticket comes back, so the actors play
    another in its place and every step trains B groups with signal. false: such groups fill
    the step's B and train nothing. Not with ppo or reinforce (every group of theirs carries
    signal)."""
    lr: float = Field(2.5e-4, gt=0)
    """AdamW learning rate (the tiny model's: a quarter of one update's 1e-3, as each batch gets
    `minibatches` updates; issue 26's study)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """The learning rate rises linearly from lr / (this x minibatches x ppo_epochs) to lr over this
    many steps (0: lr from the first update). A fresh AdamW's first updates move every weight by
    about lr, the noise's as much as the signal's."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global grad norm."""
    publish_every: int = Field(1, ge=1)
    """Publish a new weight version every k steps."""
    keep_versions: int = Field(3, ge=1)
    """Weight versions whose bytes are kept (blob transport: in Redis or weights.dir)."""
    algorithm: Literal["grpo", "drgrpo", "rloo", "reinforce", "gigpo", "ppo"] = "grpo"
    """Advantage estimator (learner/algorithms.py): grpo (mean/std per group), drgrpo (mean only, and
    the loss a token sum over a constant), rloo (leave-one-out mean of the group), reinforce (the
    batch's mean reward as baseline), gigpo (grpo plus step-level advantages over the group's turns
    taken in the same state), ppo (a critic: a value head on the policy, GAE or V-trace)."""
    loss: Literal["decoupled", "naive", "tis"] = "decoupled"
    """The off-policy correction (docs/concepts/loss.md). decoupled (AReaL): PPO's ratio against the
    learner's own weights before the batch's first update (proximal), the behaviour policy's tokens
    weighted by min(exp(lp - lb), behav_weight_cap); its clip acts only from a batch's second update
    on (minibatches or ppo_epochs > 1). naive: PPO's ratio against the behaviour log-probs, as if the
    data were fresh. tis (PipelineRL, verl's rollout correction): no ratio and no clip, the policy
    gradient weighted by min(exp(lc - lb), behav_weight_cap), tokens past behav_reject masked."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per generated token (ppo) or per turn (gigpo's step returns)."""
    gae_lambda: float = Field(1.0, ge=0, le=1)
    """ppo: GAE's lambda, and V-trace's."""
    critic_targets: Literal["auto", "gae", "vtrace"] = "auto"
    """ppo: the critic's targets and the advantages: GAE, V-trace (truncated importance weights of
    the learner's policy over the behaviour one), or auto: GAE for samples all of whose tokens come
    from the learner's current weights (0 optimizer steps behind), V-trace for stale ones."""
    vtrace_rho_bar: float = Field(1.0, gt=0)
    """ppo, V-trace: the cap on the importance weight of each step's TD error."""
    vtrace_c_bar: float = Field(1.0, gt=0)
    """ppo, V-trace: the cap on the traces' importance weights."""
    scale_advantages: bool = True
    """ppo: divide the advantages by their std over the batch's tokens as well as centring them
    (whitening, as verl does); off: centred only. One grid_nav run each: success 0.79 / 0.61 over
    the best 32 steps, 0.63 / 0.48 over the last fifth."""
    critic_lr: float | None = Field(None, gt=0)
    """ppo: the value head's learning rate (unset: learner.lr)."""
    vf_coef: float = Field(0.5, ge=0)
    """ppo: weight of the value loss."""
    vf_clip: float | None = Field(0.2, gt=0)
    """ppo: the value moves at most this far from its value before the update (clipped value loss;
    None: unclipped)."""
    gigpo_step_weight: float = Field(1.0, ge=0)
    """gigpo: weight of the step-level advantages added to the episode-level ones."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """How the policy loss weighs the samples. token-mean: every trained token alike, so a long sample
    outweighs a short one (a failed episode played to the turn cap, a short success);
    seq-mean-token-mean (verl's name): every trained sample alike, its advantages scaled by the
    batch's mean trained tokens a sample over its own. The group estimators but drgrpo (whose
    token sum over a constant is the point) only."""
    negative_weight: float = Field(1.0, ge=0, le=1)
    """The weight of negative advantages in the policy loss (each token's, after the estimator): 1
    as the estimator gives them; 0 learns only from the samples better than their group's baseline
    (positive-sample reinforcement). Between: both, the failures' push weaker. The group estimators
    only. On TextCraft it did not beat full GRPO (docs/results/textcraft-demo.md, section 7)."""
    refused_turns: Literal["train", "drop", "nonpositive"] = "train"
    """The turns whose action the env refused (the observation after it matches env.spec.refused; TextCraft's
    "Could not "). train: as every other turn; drop: out of the loss, as SFT keeps a noisy oracle's random
    actions (`omrl collect --noise`); nonpositive: their advantage at most 0, so a refused action is never
    reinforced and one in a failure is still pushed down. An outcome reward otherwise gives a refused action
    in a successful episode the advantage of its right ones (docs/results/textcraft-demo.md, section 8). The
    actor's own episode loop records them (an agent's turns are not read). nonpositive: not with ppo."""
    refused_reward: float = Field(0.0, le=0)
    """gigpo: a reward (at most 0, e.g. -0.1) on each turn whose action the env refused, in the step
    returns only: a turn that repeats a refused action ranks below one that left the same state
    otherwise, while the episodes' rewards, their advantages and every metric stay the env's. 0: off.
    Needs env.spec.refused and the actor's own episode loop (an agent's turns are not read)."""
    refused_unlikelihood: float = Field(0.0, ge=0)
    """Weight of an unlikelihood term on each turn whose action the env refused, in every group
    (those without signal too): -log(1 - P), P the policy's probability of the turn's whole action,
    summed over the refused turns and divided by the generated tokens (as the entropy bonus). A
    policy gradient barely moves an action the policy is sure of (its gradient in a token's logit is
    1 - p); this one's stays up to P there, so a refused action repeated at P = 0.99 is still pushed
    down (learner/refused_prob). 0: off. Needs env.spec.refused and the actor's own episode loop
    (an agent's turns are not read). On TextCraft at weight 1 the refused actions were not sure ones
    (P 0.22) and the policy collapsed (docs/results/textcraft-demo.md, section 11)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of a KL penalty to the frozen starting model (0: off, no reference kept). The reference is
    kept in the compute's precision (bf16 under learner.precision = "bf16"), sharded under fsdp2."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """The per-token KL estimator: k1 (log ratio) or k3 (exp(-k1) - 1 + k1, never negative)."""
    sft_coef: float = Field(0.0, ge=0)
    """Weight of a supervised term beside the RL loss (InstructGPT's PPO-ptx, OpenRLHF's ptx_coef): the
    mean negative log-likelihood per trained token of learner.sft_episodes episodes of learner.sft_data,
    drawn afresh for every optimizer update, so the policy keeps what its fine-tuning data teaches
    while RL moves it. 0: off, no data read."""
    sft_data: list[str] = Field(default_factory=list)
    """Trajectory files (parquet) for learner.sft_coef, as `omrl collect` and `omrl import-trajectories`
    write them: their `tokens` and `loss_mask` columns, which must be for the policy's tokenizer (that
    is, `--model` the policy or a model with its tokenizer). Read once at the learner's start."""
    sft_episodes: int = Field(16, ge=1)
    """learner.sft_coef: episodes of learner.sft_data per optimizer update, shared among the learner's
    ranks and cut into micro-batches as the RL samples are (learner.max_tokens_per_microbatch)."""
    token_sum_norm: int | None = Field(None, ge=1)
    """drgrpo: each sample's token sum is divided by this constant (Dr.GRPO), not by the token count
    (unset: actor.max_tokens x actor.max_turns, the longest an episode can generate)."""
    clip_eps_low: float = Field(0.2, gt=0, lt=1)
    """PPO clip range below 1."""
    clip_eps_high: float = Field(0.2, gt=0)
    """PPO clip range above 1 (clip-higher when larger than clip_eps_low)."""
    behav_weight_cap: float = Field(2.0, gt=0)
    """C: cap on the behaviour importance weight exp(lp - lb)."""
    behav_reject: float = Field(5.0, gt=1)
    """Tokens with exp(lp - lb) above this are masked out."""
    entropy_coef: float = Field(0.01, ge=0)
    """Weight of the entropy bonus (mean entropy over generated tokens), against collapse."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant for negative advantages (None: off)."""
    eta: int = Field(2, ge=0)
    """Staleness bound (async mode), in optimizer steps: actors start a group only while the groups
    started and not failed stay under (S + eta + 1) x B, S the step of the newest published weights,
    so a group trained in turn comes from weights at most eta steps older than the learner's. At
    least publish_every - 1 (weights published every k steps are up to k - 1 steps old)."""
    max_staleness: int = Field(1000, ge=0)
    """Hard cap: groups whose oldest token is more than this many optimizer steps stale go to the
    dead letters as `stale`."""
    checkpoint_every: int = Field(1, ge=1)
    """Checkpoint every k steps; groups are acknowledged only once a checkpoint holds them."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept in RUN_DIR/checkpoints (a directory each: every rank writes its own shards there,
    so with several nodes RUN_DIR must be one file system they all reach)."""
    dedup_window: int = Field(100_000, ge=1)
    """Ids of the last this-many groups trained on are remembered (and checkpointed) to skip redeliveries."""
    eval_every: int = Field(20, ge=0)
    """Every this many weight versions the evaluator (its own process and engine; `omrl run` starts it)
    plays learner.eval_tasks held-out tasks greedily on one version, the first at the first version it
    sees; the result lands in metrics.jsonl (eval/...), the sinks, the plot and `omrl status`. Nothing
    waits for it. On GPUs, `omrl run` starts it only where GPUs are left that no learner rank and no
    actor uses (it gets actor.tensor_parallel_size of them: common/gpus.py). 0: no evaluator."""
    eval_tasks: int = Field(32, ge=1)
    """Held-out tasks per evaluation during training (the first ones of the test split)."""
    samples_every: int = Field(10, ge=0)
    """Every this many steps, learner.samples_per_step episodes of the step are kept in RUN_DIR/samples.jsonl
    (text per turn, token ids, log-probs, versions, advantages, rewards) and sent to the metrics sinks as
    text; `omrl view RUN_DIR` browses them. 0: none."""
    samples_per_step: int = Field(4, ge=1)
    """Episodes kept per kept step: the best, the worst, the others drawn at random."""
    samples_max_mb: float = Field(64.0, gt=0)
    """Past this size samples.jsonl becomes samples.1.jsonl (the older one is dropped): about twice this on disk."""
    consumer: str = Field("learner-0", pattern=r"^[A-Za-z0-9_.-]+$")
    """Consumer name in the group; keep it across restarts so the learner re-reads its own pending entries."""
    threads: int = Field(1, ge=1)
    """torch intra-op threads (per rank)."""
    cpus: list[int] = Field(default_factory=list)
    """CPU cores the learner runs on (empty: any); see actor.cpus."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner trains: auto is CUDA when torch sees a GPU (rank r on GPU r), else the CPU."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: forward and backward under bf16 autocast; weights and optimizer state stay fp32."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward: less memory, about a third more compute."""
    max_tokens_per_microbatch: int = Field(16384, ge=1)
    """Padded tokens in one forward; gradients are accumulated over micro-batches, so memory follows
    this, not the batch. A longer sequence goes alone in its micro-batch."""
    vocab_chunk: int = Field(8192, ge=1)
    """Columns of the output layer computed at once for log-probs and entropy; for rows a mask
    restricted (actor.constrain_actions), allowed (row, token) pairs at once."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    minibatches: int = Field(4, ge=1)
    """Optimizer steps per pass, each on a 1/minibatches share of the batch's tokens. Above 1 (the
    default 4 at a quarter of one update's lr, from issue 26's study: docs/results/staleness.md)
    the proximal forward runs before the first and the PPO clip acts on the later ones; with
    ppo_epochs and minibatches both 1 the ratio is 1, the clip never acts and the proximal
    forward is skipped."""
    ranks: int = Field(1, ge=1)
    """Learner processes (`omrl run` starts them with torchrun); rank 0 reads the broker and publishes."""
    parallel: Literal["ddp", "fsdp2"] = "ddp"
    """With ranks > 1: ddp (each rank holds the model) or fsdp2 (parameters, gradients and optimizer
    state sharded per decoder layer; built on the meta device, each rank reading only its shards)."""
    vocab_parallel: bool = True
    """fsdp2: the embedding and the output layer split by vocabulary across the ranks, each rank
    holding and scoring its rows (the activations are exchanged instead of the weight). false:
    FSDP2 gathers them whole, with the final norm, for every forward and backward: at a 151,936
    token vocabulary that is 28% of Qwen2.5-0.5B, held whole with its whole gradient."""
    return_freed_memory: bool = True
    """Give host memory back to the system as soon as torch frees it (glibc: allocations of 64 KiB
    or more mapped on their own, unmapped on free). Without it glibc keeps the freed heap: 0.2 of
    one full fp32 train state a rank at 0.5B on 2 FSDP2 ranks. Costs page faults on the CPU
    (measured by `omrl bench shards`)."""
    checkpoint_async: bool = True
    """Write checkpoints from a background thread: each rank's shards are copied to host memory
    beside the next step (whose optimizer step waits for the copy) and written from the copy while
    training goes on; the groups they hold are acknowledged once every rank's part is durable. A
    checkpoint due while the previous one is still being written waits for it: at most
    2 x checkpoint_every steps of groups are unacknowledged. false: written from the training's
    own tensors, no copy, while the loop waits."""
    seed: int = 0
    """Seed for torch, and of the supervised term's draws (learner.sft_coef)."""

    @property
    def steps_ahead(self) -> int:
        """How many optimizer steps actors may run ahead of the learner's newest published weights:
        eta, or in sync mode the steps one version serves (publish_every - 1)."""
        return self.publish_every - 1 if self.mode == "sync" else self.eta


class WeightsConfig(Section):
    """How a weight version travels from the learner to the actors' engines."""

    transport: Literal["blob", "broadcast"] = "blob"
    """blob: safetensors bytes in Redis chunks (or a file in weights.dir); broadcast: buckets over one
    gloo group of the learner's rank 0 and every actor, relayed down a chain (the learner sends each
    version once, whatever the number of actors) and staged by each actor beside generation; no
    bytes in Redis."""
    dir: str | None = None
    """blob transport: a directory every learner and actor process sees (a shared volume); the bytes go
    there instead of into Redis. It holds one run's weights: older version files in it are deleted.
    Unset where `omrl run` starts its own Redis: RUN_DIR/weights (everything runs on one host)."""
    chunk_mb: int = Field(64, ge=1)
    """blob transport in Redis: the largest value written (the server's proto-max-bulk-len caps it too)."""
    host: str | None = None
    """broadcast: the name or address actors reach the learner at (unset: the learner's host name)."""
    port: int = Field(0, ge=0, le=65535)
    """broadcast: the learner's rendezvous port (0: a free one; actors read it from Redis)."""
    bucket_mb: int = Field(256, ge=1)
    """broadcast: tensors are sent in buckets of about this size; an actor holds two while relaying."""
    timeout_s: float = Field(120.0, gt=0)
    """broadcast: a send, a group's start or an actor's word on a send fails past this; an actor silent
    that long is dropped from the group (it joins again), and the others go on."""


class SupervisorConfig(Section):
    """How `omrl run` keeps its processes alive (the names follow supervisord and systemd)."""

    restart: Literal["on-failure", "never"] = "on-failure"
    """on-failure: restart a process that exits (the learner: unless it finished with code 0); never: stop the run."""
    max_restarts: int = Field(5, ge=0)
    """Restart budget per process: at most this many restarts within restart_window_s, then the run stops."""
    restart_window_s: float = Field(600.0, gt=0)
    """The window of the restart budget; older restarts no longer count."""
    backoff_s: float = Field(1.0, ge=0)
    """Delay before the first restart; it doubles with each restart still in the window."""
    backoff_max_s: float = Field(30.0, ge=0)
    """Longest delay before a restart."""
    start_s: float = Field(10.0, ge=0)
    """A process that exits this soon after its first start stops the run at once: a start failure is
    a configuration or installation problem, which restarts do not fix."""
    log_lines: int = Field(20, ge=0)
    """Lines of a process's log shown when it exits."""
    hang_s: float = Field(300.0, ge=0)
    """A process alive but making no progress this long (its beat file, common/liveness.py: the env
    server's loop, an actor's engine finishing calls, the learner between steps; Redis's answered
    PINGs; an env worker's loop, to its parent) is killed and restarted, and the log says so.
    Above the longest learner step and synchronous checkpoint. 0: off."""
    start_grace_s: float = Field(900.0, gt=0)
    """A process that has not yet made progress this long after a start (vLLM's start, loading the
    model) is taken as hung too."""
    log_max_mb: float = Field(64.0, ge=0)
    """A process's log (RUN_DIR/logs/NAME.log) past this size is copied to NAME.log.1 (replacing the
    older copy) and emptied in place, as logrotate's copytruncate does: a run of days keeps at most
    about twice this a process. The process writes on (its log is open for appending); lines it
    writes between the copy and the emptying are lost. 0: never rotated."""


class SFTConfig(Section):
    """`omrl sft`: supervised fine-tuning on trajectory files (its flags of the same names set these)."""

    epochs: float = Field(3.0, gt=0)
    """Passes over the data."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate (1e-3: a tiny model from scratch)."""
    batch_size: int = Field(32, ge=1)
    """Episodes per optimizer step."""
    warmup: int = Field(20, ge=0)
    """Warm-up steps of the learning rate."""
    max_tokens_per_microbatch: int = Field(16384, ge=1)
    """Padded tokens per forward."""
    holdout: float = Field(0.05, ge=0, lt=1)
    """Fraction of the episodes kept apart for a held-out loss."""
    eval_env: str | None = None
    """The env whose held-out tasks the model plays (unset: the data's env)."""
    eval_episodes: int = Field(200, ge=0)
    """Held-out tasks per evaluation (0: no evaluation)."""
    eval_every: float = Field(1.0, gt=0)
    """Epochs between evaluations (and one at the end)."""
    eval_start: bool = True
    """Also evaluate the model before the first step (false: where an untrained model playing every
    turn of every task would cost more than the point is worth)."""
    seed: int = 0
    """Seed of the shuffles, the held-out slice and torch."""


class RunConfig(Section):
    run_dir: str = "runs/latest"
    """Where metrics.jsonl, logs, the model and weights go."""
    log_level: str = "INFO"
    """Python logging level for every process."""
    plugins: list[str] = Field(default_factory=list)
    """Modules of your own (dotted names, importable: installed, or on PYTHONPATH) that every role and
    command imports before any check: they register envs, reward functions and action templates."""
    metrics: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"])
    """Where the learner's and `omrl sft`'s metrics go. RUN_DIR/metrics.jsonl is always written (plots,
    `omrl status` and resumes read it); "tensorboard" writes event files in RUN_DIR/tensorboard
    (`tensorboard --logdir RUN_DIR`), "wandb" a W&B run in RUN_DIR/wandb in run.wandb_mode, "mlflow" an
    MLflow run at run.mlflow_uri (both: pip install 'openmanus-rl[metrics]'). What each metric means:
    docs/reference/metrics.md."""
    wandb_project: str = "openmanus-rl"
    """The W&B project of runs with "wandb" in run.metrics; the run is named after RUN_DIR."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: W&B writes RUN_DIR/wandb with no account or network (upload later: wandb sync
    RUN_DIR/wandb/offline-run-*); online: it logs in (WANDB_API_KEY) and sends as it goes."""
    mlflow_uri: str | None = None
    """The MLflow tracking store of runs with "mlflow" in run.metrics: a server (http://host:5000) or a
    database URI. Unset: RUN_DIR/mlflow.db, artifacts in RUN_DIR/mlartifacts (`mlflow ui
    --backend-store-uri sqlite:///RUN_DIR/mlflow.db`, with the full mlflow package)."""
    mlflow_experiment: str = "openmanus-rl"
    """The MLflow experiment of runs with "mlflow" in run.metrics; the run is named after RUN_DIR."""
    plot_every_s: float = Field(300.0, ge=0)
    """`omrl run` redraws RUN_DIR/metrics.png this often while the run goes on, and at its end; 0: only at
    the end. `omrl plot RUN_DIR` draws it at any time."""


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)

    @model_validator(mode="after")
    def _check(self) -> Config:
        lcfg = self.learner
        pending, formula = unacknowledged(lcfg.checkpoint_every, lcfg.groups_per_step, lcfg.checkpoint_async)
        if self.redis.max_stream_len * self.redis.shards < pending:
            raise ValueError(
                f"redis.max_stream_len x redis.shards must hold the {pending} groups that can wait for a checkpoint "
                f"({formula}): raise redis.max_stream_len or lower learner.checkpoint_every")
        if self.learner.dedup_window < pending + self.redis.max_stream_len * self.redis.shards:
            raise ValueError(
                f"learner.dedup_window must cover the groups that can be pending or waiting in the streams "
                f"({pending + self.redis.max_stream_len * self.redis.shards}): raise learner.dedup_window")
        if lcfg.loss_agg != "token-mean" and lcfg.algorithm in ("ppo", "drgrpo"):
            raise ValueError(f"learner.loss_agg = {lcfg.loss_agg!r} works with grpo, rloo, reinforce and gigpo, not "
                             f"{lcfg.algorithm}: set learner.loss_agg = \"token-mean\" or another learner.algorithm")
        if lcfg.negative_weight != 1.0 and lcfg.algorithm in CRITIC_ALGORITHMS:
            raise ValueError(f"learner.negative_weight = {lcfg.negative_weight:g} works with the group estimators, "
                             f"not ppo (its advantages come from the critic): set learner.negative_weight = 1.0 "
                             f"or another learner.algorithm")
        if lcfg.refused_turns == "nonpositive" and lcfg.algorithm in CRITIC_ALGORITHMS:
            raise ValueError("learner.refused_turns = \"nonpositive\" works with the group estimators, not ppo (its "
                             "advantages come from the critic): set learner.refused_turns = \"drop\" or another "
                             "learner.algorithm")
        if lcfg.refused_reward and lcfg.algorithm != "gigpo":
            raise ValueError(f"learner.refused_reward = {lcfg.refused_reward:g} is a turn reward of gigpo's step "
                             f"returns, not of {lcfg.algorithm}: set learner.algorithm = \"gigpo\" or "
                             f"learner.refused_reward = 0")
        if lcfg.filter_groups and lcfg.algorithm not in GROUP_RELATIVE:
            raise ValueError(f"learner.filter_groups drops the groups a group-relative estimator gives no "
                             f"advantage, and every group of {lcfg.algorithm} carries one: set "
                             f"learner.filter_groups = false or a group-relative learner.algorithm "
                             f"({', '.join(GROUP_RELATIVE)})")
        if lcfg.sft_coef > 0 and not lcfg.sft_data:
            raise ValueError(f"learner.sft_coef = {lcfg.sft_coef:g} needs episodes to train on: set learner.sft_data "
                             f"to trajectory files (`omrl collect`), or learner.sft_coef = 0")
        if lcfg.mode == "async" and lcfg.eta < lcfg.publish_every - 1:
            raise ValueError(f"learner.eta ({lcfg.eta}) must be at least learner.publish_every - 1 "
                             f"({lcfg.publish_every - 1}): eta counts optimizer steps, and weights published every "
                             f"{lcfg.publish_every} steps are already up to {lcfg.publish_every - 1} steps old; raise "
                             f"learner.eta or lower learner.publish_every")
        if lcfg.max_staleness < lcfg.publish_every - 1:
            raise ValueError(f"learner.max_staleness ({lcfg.max_staleness}) must be at least learner.publish_every - 1 "
                             f"({lcfg.publish_every - 1}): between publications even the newest weights' groups are "
                             f"that many optimizer steps stale, and dead-lettering them would stall the run; raise "
                             f"learner.max_staleness or lower learner.publish_every")
        if self.redis.ticket_ttl_s < 3 * self.actor.heartbeat_s:
            raise ValueError(f"redis.ticket_ttl_s must be at least 3 x actor.heartbeat_s ({3 * self.actor.heartbeat_s}s): "
                             f"heartbeats renew tickets, and one missed heartbeat must not return them")
        if self.actor.max_model_len is not None and self.actor.max_model_len < self.actor.max_seq_len:
            raise ValueError("actor.max_model_len must be at least actor.max_seq_len (an episode's context): raise "
                             "max_model_len or lower max_seq_len")
        if self.learner.algorithm == "drgrpo" and self.learner.token_sum_norm is None:
            self.learner.token_sum_norm = self.actor.max_tokens * self.actor.max_turns
        if self.actor.agent and self.actor.agent_url:
            raise ValueError("actor.agent and actor.agent_url are both set: an agent is either a Python callable "
                             "(agent) or an HTTP service (agent_url); unset one")
        if self.actor.agent and not re.fullmatch(r"[^:\s]+:\w+", self.actor.agent):
            raise ValueError(f"actor.agent must be \"module:function\" or \"path/to/file.py:function\" (an async def "
                             f"rollout(task, client)), "
                             f"got {self.actor.agent!r}")
        if self.actor.agent_url and not self.actor.agent_url.startswith(("http://", "https://")):
            raise ValueError(f"actor.agent_url must be an http(s) URL, got {self.actor.agent_url!r}")
        if self.actor.task_pool is not None and self.actor.task_sampling != "spread":
            raise ValueError(f"actor.task_pool = {self.actor.task_pool!r} pools tasks for actor.task_sampling = "
                             f"\"spread\" only: set task_sampling = \"spread\" or unset task_pool")
        if self.actor.max_tokens >= self.actor.max_seq_len:
            raise ValueError("actor.max_tokens must be below actor.max_seq_len: raise max_seq_len or lower max_tokens")
        if self.actor.constrain_actions and self.actor.action_template != "raw":
            raise ValueError(f"actor.constrain_actions decodes the whole turn as one of the env's actions, which "
                             f"action_template {self.actor.action_template!r} wraps in other text: set "
                             f"actor.action_template = \"raw\" or constrain_actions = false")
        if self.actor.constrain_actions and (self.actor.agent or self.actor.agent_url):
            raise ValueError("actor.constrain_actions masks the turns of the episode loop, and an agent's calls "
                             "(actor.agent, actor.agent_url) go through the OpenAI endpoint unmasked: unset "
                             "constrain_actions, or the agent to play the episode loop")
        learner = self.learner
        if self.actor.constrain_actions and learner.ranks > 1 and learner.parallel == "fsdp2" and learner.vocab_parallel:
            raise ValueError("actor.constrain_actions: the learner scores each masked token over its allowed tokens, "
                             "which it does not do with the output layer split by vocabulary: set "
                             "learner.vocab_parallel = false (or constrain_actions = false)")
        return self


class ConfigError(ValueError):
    """Bad configuration: the message names the field and the fix."""


# What to pass for a field a process needs that is unset (`omrl run` fills them in itself).
UNSET = {
    "model.path": "pass --set model.path=DIR (a directory written by save_pretrained, or `omrl init-model DIR`), "
                  "or a hub id",
    "redis.url": "pass --set redis.url=redis://HOST:PORT/0 (the run's Redis)",
    "env.url": "pass --set env.url=http://HOST:PORT (the env server's)",
}


def unset_field(cfg: Config, *fields: str) -> str | None:
    """The first of `fields` (dotted names, keys of UNSET) that `cfg` leaves unset, if any."""
    for dotted in fields:
        section, name = dotted.split(".")
        if not getattr(getattr(cfg, section), name):
            return dotted
    return None


def require_set(cfg: Config, *fields: str) -> None:
    """SystemExit with one line (what is unset, what to pass) when one of `fields` is unset."""
    dotted = unset_field(cfg, *fields)
    if dotted is not None:
        raise SystemExit(f"error: {dotted} is unset: {UNSET[dotted]}")


def _parse_value(text: str) -> Any:
    """A TOML literal if it parses as one (42, 0.5, true, [1, 2], "x"), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {dotted!r}: use section.field=value, for example learner.lr=1e-3")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
    node[parts[-1]] = value


def env_overrides(environ: dict[str, str] | None = None) -> list[str]:
    """OMRL_LEARNER__LR=1e-3 -> ["learner.lr=1e-3"]. An empty variable sets nothing (compose's
    `${VAR:-}` passes a variable the user did not set as an empty one)."""
    environ = os.environ if environ is None else environ
    out = []
    for key, value in environ.items():
        if key.startswith(ENV_PREFIX) and "__" in key and value != "":
            dotted = key[len(ENV_PREFIX):].lower().replace("__", ".")
            out.append(f"{dotted}={value}")
    return sorted(out)


def load_config(path: str | Path | None = None, overrides: list[str] = (), environ: dict[str, str] | None = None) -> Config:
    """Load the TOML file (if any), then environment overrides, then --set overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            tree = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist: pass an existing TOML file to --config") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for item in [*env_overrides(environ), *overrides]:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: use section.field=value, for example learner.lr=1e-3")
        dotted, text = item.split("=", 1)
        _set_dotted(tree, dotted.strip(), _parse_value(text.strip()))
    for dotted, value in model_defaults(tree).items():  # only where nothing above set the field
        section, field = dotted.split(".")
        if isinstance(tree.setdefault(section, {}), dict):  # not a table: validation names the field
            tree[section].setdefault(field, value)
    try:
        config = Config.model_validate(tree)
    except ValidationError as exc:
        lines = []  # one line per problem, each naming its field
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "config"
            got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
            lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}{got}")
        raise ConfigError("\n".join(lines)) from None
    import_plugins(config.run.plugins)
    return config


def import_plugins(modules: list[str]) -> None:
    """Import run.plugins (each registers what it defines); a module that fails names itself."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - whatever the user's module raises, say which and why
            raise ConfigError(f"run.plugins: cannot import {name!r} ({type(exc).__name__}: {exc}): install its "
                              f"package, or put the directory that holds it on PYTHONPATH") from None


# Defaults that follow the model (docs/guides/real-model.md, "Defaults that follow the model"). The field defaults above
# are the tiny model's (4-token turns that stop at a line break, lr 2.5e-4, an entropy bonus); a model of
# real size (at least REAL_SIZE parameters by its config.json) gets these instead, wherever the config
# does not set the field itself.
REAL_SIZE = 100_000_000
REAL_MODEL = {"actor.max_tokens": 512, "actor.max_seq_len": 4096, "learner.lr": 1e-6, "learner.entropy_coef": 0.0,
              "learner.checkpoint_every": 10, "learner.gradient_checkpointing": True}
# A checkpoint every 10 steps cost 0.02 of the training time at 0.5B on 2 CPU ranks, one every step 0.2
# (`omrl bench shards`); the streams then hold the groups that wait for it (redis.max_stream_len, below).
# Gradient checkpointing: sequences of actor.max_seq_len tokens; at 0.5B on 2 CPU ranks it took a rank's
# peak from 0.67 to 0.59 of a full fp32 train state (8 sequences of 64-128 tokens) for x1.10 step time.
# actor.stop when the config does not set it: a real-size model with a chat template stops at its end of
# turn (the end-of-sequence tokens vLLM stops on: no stop string); otherwise the action template's.
TEMPLATE_STOP = {"react": ["\nObservation:"], "tag": ["</action>"]}  # others: a line break


def model_defaults(tree: dict[str, Any]) -> dict[str, Any]:
    """The defaults the config's model and action template give (dotted name -> value), read from
    the model directory's JSON files (no model is loaded). A model that is not a local directory
    (a hub id) gets none but the template's stop."""
    import json

    actor, model = (tree.get(name) if isinstance(tree.get(name), dict) else {} for name in ("actor", "model"))
    template = actor.get("action_template", ActorConfig.model_fields["action_template"].default)
    out: dict[str, Any] = {"actor.stop": TEMPLATE_STOP.get(template, ["\n"])}
    path = Path(str(model["path"])) if model.get("path") else None
    if path is None or not (path / "config.json").is_file():
        return out
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return out  # preflight reports an unreadable model
    if count_parameters(hf) < REAL_SIZE:
        return out
    out.update(REAL_MODEL)
    learner, redis = (tree.get(name) if isinstance(tree.get(name), dict) else {} for name in ("learner", "redis"))
    every = learner.get("checkpoint_every", REAL_MODEL["learner.checkpoint_every"])
    per_step = learner.get("groups_per_step", LearnerConfig.model_fields["groups_per_step"].default)
    background = learner.get("checkpoint_async", LearnerConfig.model_fields["checkpoint_async"].default)
    shards = redis.get("shards", RedisConfig.model_fields["shards"].default)
    if isinstance(every, int) and isinstance(per_step, int) and isinstance(shards, int) and shards > 0:
        # Room for the groups that can wait for a checkpoint (Config._check's rule).
        pending, _ = unacknowledged(every, per_step, bool(background))
        out["redis.max_stream_len"] = max(RedisConfig.model_fields["max_stream_len"].default, -(-pending // shards))
    if isinstance(hf.get("max_position_embeddings"), int):
        out["actor.max_seq_len"] = min(REAL_MODEL["actor.max_seq_len"], hf["max_position_embeddings"])
    if hf.get("torch_dtype") in ("bfloat16", "float16"):
        out["model.dtype"] = hf["torch_dtype"]
    if actor.get("chat_template", "auto") == "auto" and _has_chat_template(path):
        out["actor.stop"] = []
    return out


def unacknowledged(checkpoint_every: int, groups_per_step: int, background: bool) -> tuple[int, str]:
    """The most groups the learner holds unacknowledged, and the formula in words: the steps since
    the last checkpoint, the batch being read and, when checkpoints are written in the background,
    the steps of the one being written."""
    if background:
        return 2 * checkpoint_every * groups_per_step, "2 x learner.checkpoint_every x learner.groups_per_step"
    return (checkpoint_every + 1) * groups_per_step, "(learner.checkpoint_every + 1) x learner.groups_per_step"


def count_parameters(hf: dict[str, Any]) -> int:
    """About how many parameters a decoder-only model of this config.json has (embeddings, attention
    with its key-value heads, gated MLP); 0 where the config does not say."""
    try:
        h, layers, vocab = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return 0
    heads = int(hf.get("num_attention_heads") or 1)
    kv = int(hf.get("num_key_value_heads") or heads)
    inter = int(hf.get("intermediate_size") or 4 * h)
    attention = 2 * h * h + 2 * h * (h // heads) * kv
    embeddings = vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + 3 * h * inter)


def _has_chat_template(path: Path) -> bool:
    import json

    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


# The one TOML writer: the resolved config (`dump_toml`), run files a command writes (`to_toml`)
# and --set values (`common.cli.override`) all go through `toml_value`.
def toml_value(value: Any) -> str:
    """`value` as a TOML literal: tomllib reads it back equal (inline tables for dicts)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 32 or ord(c) == 127 else c)
                             for c in value) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def toml_key(key: str) -> str:
    """A bare key where TOML allows one, else a quoted one."""
    return key if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key) else toml_value(key)


def to_toml(tree: dict[str, dict[str, Any]]) -> str:
    """Sections of fields as TOML, one [section] table each (None values are left out: they mean 'unset')."""
    out = []
    for section, values in tree.items():
        out.append(f"[{toml_key(section)}]")
        out.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in values.items() if v is not None)
        out.append("")
    return "\n".join(out)


def dump_toml(config: Config) -> str:
    """The resolved config as TOML (None values are left out: they mean 'unset')."""
    return to_toml(config.model_dump(exclude_none=True))
