"""The token-exact episode loop.

One growing token buffer per episode: the prompt, then every generated token exactly as
the engine sampled it (mask 1, its behaviour log-prob and weight version), then every
observation's tokens (mask 0). Nothing generated is ever re-tokenised. The setup's format
(actors/chat.py) says which context tokens surround the turns: the model's chat template
(its end-of-turn tokens the model did not sample, a user turn, the generation prompt), or
plain text.

Each turn the action template reads the action out of the generated text; one that does
not parse is answered as AgentGym's clients answer it (no server call, "Invalid Action."
and the last observation, reward 0); a turn the env refused (its observation matches the env
spec's `refused`) is recorded as such (learner.refused_turns). At the end the env's success
rule and the configured reward functions score the episode (they see its task and every turn:
envs/rewards.py). An env or reward function failure raises (an `EpisodeError`); the caller
fails the episode's whole group.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from actors.chat import TurnFormat, make_format
from actors.choices import Choices
from actors.engine import Engine, Generation
from actors.templates import INVALID_ACTION, ActionTemplate
from actors.weights import WeightGate
from common.config import ActorConfig
from common.messages import Sample
from envs.base import StepResult
from envs.client import EnvClient
from envs.rewards import Episode, EpisodeTurn, combine


class TokenBuffer:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.allowed: list[list[int]] = []  # per token: what the mask let through ([]: not masked)

    def add_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.allowed += [[]] * len(ids)

    def add_generated(self, ids: list[int], logprobs: list[float], version: int | list[int],
                      allowed: list[list[int]] | None = None) -> None:
        """`version`: the weight version of every token, or of each (a turn an update interrupted);
        `allowed`: the tokens the mask let through at each (actor.constrain_actions), None: unmasked."""
        self.tokens += ids
        self.allowed += allowed if allowed is not None else [[]] * len(ids)
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += version if isinstance(version, list) else [version] * len(ids)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass
class Turn:
    """One turn of a policy: the tokens it generated (their log-probs and weight version), and
    the action when the policy chose it directly (None: the template reads it from the text)."""

    generation: Generation
    version: int | list[int]
    """The weight version of its tokens, or a version per token (an update came mid-turn)."""
    action: str | None = None
    trained: bool = True
    """False: a turn taken to reach other states, not to be learned from (a noisy oracle's
    random action): its tokens go into the episode as context, outside the loss mask."""


class Policy(Protocol):
    uses_choices: bool
    """Whether its turns can take `choices`: the episode loop asks the env for its actions only then."""

    async def act(self, tokens: list[int], budget: int, env_id: int, stops: list[str] | None = None,
                  choices: Choices | None = None) -> Turn:
        """`stops`: stop strings in place of the engine's (actor.stop); the endpoint's requests bring theirs.
        `choices`: the token sequences the turn must be one of (actor.constrain_actions; the episode
        loop passes it only then)."""


class ModelPolicy:
    """The engine samples; the weight gate names the weight version of every token. A call an
    update interrupts (finish reason "abort") is continued on the new weights from the tokens
    it has; one an update kept running (keep mode) has its tokens after each swap labelled
    with the version that swap loaded: each token keeps the version that sampled it."""

    uses_choices = True

    def __init__(self, engine: Engine, gate: WeightGate):
        self.engine, self.gate = engine, gate

    async def act(self, tokens: list[int], budget: int, env_id: int, stops: list[str] | None = None,
                  choices: Choices | None = None) -> Turn:
        """`stops`: the request's stop strings in place of the engine's (actor.stop); None: the engine's.
        `choices`: the token sequences the turn must be one of (actor.constrain_actions)."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            rest = None if choices is None else choices.continued(ids)
            if choices is not None and rest is None:  # an update came just as the turn completed a choice
                return Turn(Generation(ids, logprobs, "stop"), versions)
            async with self.gate.generating() as version:
                applied = self.gate.applied
                gen = await self.engine.generate(tokens + ids, budget - len(ids), turn_start=len(tokens) if ids else None,
                                                 sent=self.gate.sent, stops=stops, choices=rest)
                swapped = self.gate.versions_since(applied, len(gen.swaps))
            ids += gen.token_ids
            logprobs += gen.logprobs
            versions += labels(version, gen.swaps, swapped, len(gen.token_ids))
            if gen.finish_reason != "abort" or len(ids) >= budget:
                finish = "length" if gen.finish_reason == "abort" else gen.finish_reason
                return Turn(Generation(ids, logprobs, finish), versions)


def allowed_arrays(allowed: list[list[int]]) -> dict[str, np.ndarray]:
    """Sample.allowed_counts and Sample.allowed from each token's allowed tokens; none where no
    token was masked."""
    counts = np.fromiter(map(len, allowed), np.int32, len(allowed))
    if not counts.any():
        return {}
    return {"allowed_counts": counts, "allowed": np.fromiter((t for a in allowed for t in a), np.int32, int(counts.sum()))}


def labels(version: int, swaps: list[int], swapped: list[int], n: int) -> list[int]:
    """The version of each of a call's `n` tokens: `version` before its first swap, then each
    swap's version (`swapped`) from the token count it had then (`swaps`) on."""
    out = [version] * n
    for at, new in zip(swaps, swapped):
        out[at:] = [new] * max(0, n - at)
    return out


@dataclasses.dataclass
class EpisodeSetup:
    """What every episode of one actor (or one evaluation) shares."""

    env: EnvClient
    tokenizer: object
    cfg: ActorConfig
    template: ActionTemplate
    env_name: str
    task_data: dict[int, dict] = dataclasses.field(default_factory=dict)
    """Each task's other task-file columns, which reward functions see (envs.tasks.task_data)."""
    format: TurnFormat = dataclasses.field(init=False)
    """How turns become context tokens: chosen once from actor.chat_template and the tokenizer."""
    choices: Callable[[tuple[str, ...]], Choices] = dataclasses.field(init=False, repr=False)
    """The actions an env admits as the turns the model may write (actor.constrain_actions)."""

    def __post_init__(self) -> None:
        self.format = make_format(self.tokenizer, self.cfg.chat_template, self.cfg.stop)
        # An env admits the same actions turn after turn (TextCraft's hundreds, each episode's
        # every turn): each list is tokenized once, not every turn.
        self.choices = functools.lru_cache(maxsize=256)(self._choices)

    def _choices(self, actions: tuple[str, ...]) -> Choices:
        """The actions the env admits, as the model writes them: each as a turn (its end included)."""
        return Choices.of([self.format.agent_turn(a) for a in actions])

    @property
    def system(self) -> str:
        """actor.system_prompt, then the action template's instructions and a line break."""
        instructions = self.template.instructions
        return self.cfg.system_prompt + (instructions + "\n" if instructions else "")


def state_key(result: StepResult) -> str:
    """A short key of the state an env result leaves the agent in (GiGPO's anchor states): the env's
    own `info["state"]` where it reports one, else the observation (what the agent sees), hashed."""
    key = result.info.get("state", result.observation) if isinstance(result.info, dict) else result.observation
    return hashlib.blake2b(str(key).encode(), digest_size=8).hexdigest()


async def run_episode(setup: EpisodeSetup, policy: Policy, task_idx: int,
                      transcript: list[dict[str, str]] | None = None) -> Sample:
    """One episode of `task_idx`. With `transcript`, the conversation is appended to it as the
    token buffer takes it in (AgentGym's `from`/`value` turns: system, human, gpt), so that
    `actors.trajectories.tokenize` rebuilds the buffer's tokens from it."""
    note = transcript.append if transcript is not None else (lambda turn: None)
    cfg, env, spec = setup.cfg, setup.env, setup.env.spec
    started = time.monotonic()
    gen_s = env_s = 0.0
    buf = TokenBuffer()
    turns: list[EpisodeTurn] = []
    states: list[str] = []
    finish, done, info = "max_turns", False, {}
    env_id, first = await env.start(task_idx)
    in_order = False
    try:
        observation, total = first.observation, first.reward
        prompt = observation
        state = state_key(first)
        buf.add_context(setup.format.first_prompt(setup.system, observation))
        if setup.system:
            note({"from": "system", "value": setup.system})
        note({"from": "human", "value": observation})
        for _turn in range(cfg.max_turns):
            budget = min(cfg.max_tokens, cfg.max_seq_len - len(buf))
            if budget <= 0:
                finish = "context"
                break
            states.append(state)
            t0 = time.monotonic()
            actions = (tuple(await env.actions(env_id))
                       if cfg.constrain_actions and getattr(policy, "uses_choices", False) else ())
            choices = {"choices": setup.choices(actions)} if actions else {}
            turn = await policy.act(buf.tokens, budget, env_id, **choices)
            allowed = choices["choices"].along(turn.generation.token_ids) if choices else None
            t1 = time.monotonic()
            text = setup.tokenizer.decode(turn.generation.token_ids, skip_special_tokens=True)
            action = turn.action if turn.action is not None else setup.template.parse(text)
            if action is None:  # AgentGym's convention: no server call
                next_text = INVALID_ACTION + observation
                turns.append(EpisodeTurn(text, None, next_text, 0.0, False))
            else:
                result = await env.step(env_id, spec.tidy(action))
                reward = result.reward - total if spec.reward_is_total else result.reward
                total = result.reward if spec.reward_is_total else total + result.reward
                observation, done, info = result.observation, result.done, result.info
                state = state_key(result)
                next_text = observation
                turns.append(EpisodeTurn(text, action, observation, reward, done, dict(info)))
            if turn.trained:
                buf.add_generated(turn.generation.token_ids, turn.generation.logprobs, turn.version, allowed)
            else:
                buf.add_context(turn.generation.token_ids)
            note({"from": "gpt", "value": turn.action if turn.action is not None else text,
                  **({} if turn.trained else {"loss": False})})
            env_s += time.monotonic() - t1
            gen_s += t1 - t0
            if done:
                finish = "done"
                break
            context_ids = setup.format.next_turn(turn.generation.token_ids, next_text)
            if len(buf) + len(context_ids) >= cfg.max_seq_len:
                finish = "context"
                break
            buf.add_context(context_ids)
            note({"from": "human", "value": next_text})
        in_order = True
    finally:
        await env.finish(env_id, in_order)  # kept for the next episode, or closed
    episode = Episode(turns=turns, success=spec.succeeded(done, total, info), generated_tokens=sum(buf.loss_mask),
                      token_budget=cfg.max_turns * cfg.max_tokens, finish_reason=finish, task_idx=task_idx,
                      task=setup.task_data.get(task_idx, {}), env_name=setup.env_name, prompt=prompt)
    turn_rewards = episode.turn_rewards
    return Sample(
        tokens=np.asarray(buf.tokens, np.int32),
        loss_mask=np.asarray(buf.loss_mask, np.uint8),
        logprobs=np.asarray(buf.logprobs, np.float32),
        versions=np.asarray(buf.versions, np.int32),
        **allowed_arrays(buf.allowed),
        reward=await combine(cfg.rewards, episode, cfg.reward_timeout_s),
        turn_rewards=np.asarray(turn_rewards, np.float32),
        num_turns=len(turn_rewards),
        finish_reason=finish,
        task_id=str(task_idx),
        env_name=setup.env_name,
        success=episode.success,
        invalid_actions=len(turns) - sum(episode.valid_actions),
        turn_states=states[:len(turn_rewards)],
        refused_turns=[k for k, t in enumerate(turns) if t.action is not None and spec.refuses(t.observation)],
        timing={"total_s": time.monotonic() - started, "generate_s": gen_s, "env_s": env_s},
    )
