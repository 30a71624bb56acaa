"""One client for every AgentGym server: both protocol families and every answer shape, each
checked against a server that answers with the exact JSON AgentGym's servers send
(../shared/notes/agentgym-protocol.md), over real HTTP. The episode loop on top turns
running-total scores into per-turn rewards, applies the success rule of each env, and
answers actions that do not parse as AgentGym's clients do."""

import asyncio

import aiohttp
import pytest
from aiohttp import web
from transformers import AutoTokenizer

from actors.engine import Generation
from actors.episode import EpisodeSetup, Turn, run_episode
from actors.templates import make_template
from broker.embedded import free_port
from common.config import ActorConfig
from envs.client import EnvClient, EnvError
from envs.specs import spec_for


class ScriptedServer:
    """Answers each route with what a handler returns (a value, or a (status, value) pair),
    and records every request's path, query and JSON body."""

    def __init__(self, routes):
        self.routes, self.requests = routes, []

    async def handle(self, request):
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.path, dict(request.query), body))
        answer = self.routes[request.path](body, request.query)
        status, value = answer if isinstance(answer, tuple) else (200, answer)
        return web.json_response(value, status=status)

    async def __aenter__(self):
        app = web.Application()
        for path in self.routes:
            app.router.add_route("*", path, self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.session.close()
        await self.runner.cleanup()

    def client(self, env: str, protocol=None) -> EnvClient:
        return EnvClient(f"http://127.0.0.1:{self.port}", self.session, timeout_s=5, spec=spec_for(env, protocol))


def test_id_family_babyai_answers():
    async def scenario():
        routes = {
            "/create": lambda b, q: {"id": 7},
            "/reset": lambda b, q: {"observation": "Your goal: go to the red ball", "reward": 0, "score": 0,
                                    "deleted": False, "done": False},
            "/step": lambda b, q: ({"error": "The id 99 is not valid."} if b["id"] == 99 else
                                   {"observation": "The task is completed.", "reward": 0.86, "score": 0.86,
                                    "done": True}),
            "/observation": lambda b, q: {"observation": "now", "reward": 0, "score": 0, "done": False,
                                          "deleted": False},
            "/close": lambda b, q: True,
        }
        async with ScriptedServer(routes) as server:
            client = server.client("babyai")
            env_id = await client.create()
            first = await client.reset(env_id, 41)
            step = await client.step(env_id, "go to red ball 1")
            with pytest.raises(EnvError, match="HTTP 200: The id 99 is not valid"):
                await client.step(99, "turn left")  # errors answered as HTTP 200
            assert await client.observation(env_id) == "now"  # babyai answers /observation with an object
            await client.close(env_id)
            return env_id, first, step, server.requests

    env_id, first, step, requests = asyncio.run(scenario())
    assert env_id == 7 and first.observation.startswith("Your goal") and first.reward == 0
    assert step.reward == 0.86 and step.done and step.info["score"] == 0.86  # babyai: score is the reward
    assert requests[0] == ("/create", {}, None)
    assert requests[1] == ("/reset", {}, {"id": 7, "data_idx": 41})
    assert requests[2] == ("/step", {}, {"id": 7, "action": "go to red ball 1"})
    assert requests[4] == ("/observation", {"id": "7"}, None)
    assert requests[5] == ("/close", {}, {"id": 7})


def test_id_family_textcraft_and_alfworld_requests():
    async def scenario():
        routes = {
            "/create": lambda b, q: {"id": 0, "observation": "Crafting commands: ...", "done": False, "reward": 0},
            "/reset": lambda b, q: {"id": 0, "observation": "Goal: craft stick.", "done": False, "reward": 0,
                                    "available_actions": ["look"], "task_type": "pick"},
        }
        async with ScriptedServer(routes) as server:
            craft = server.client("textcraft")
            assert await craft.create() == 0
            assert (await craft.reset(0, 3)).observation == "Goal: craft stick."
            alf = server.client("alfworld")
            await alf.reset(0, 2421)
            return server.requests

    requests = asyncio.run(scenario())
    assert requests[0] == ("/create", {}, {})  # textcraft's /create takes a JSON body
    assert requests[2] == ("/reset", {}, {"id": 0, "game": 2421, "world_type": "Text"})


@pytest.mark.parametrize("env, create, reset, step, expect_reset_field", [
    # webshop: bare int from /create, [observation, null] from /reset, `state` in /step.
    ("webshop", 3, ["WebShop [SEP] Instruction: ...", None],
     {"state": "You have clicked Buy Now.", "reward": 0.75, "done": True, "info": None}, "session_id"),
    # sqlgym: the same shapes, the task named item_id.
    ("sqlgym", 0, ["Question: how many ...", None], {"state": "[(3,)]", "reward": 1, "done": True, "info": {}},
     "item_id"),
    # tool envs: the observation string itself from /reset.
    ("weather", 5, "Today's weather is ...", {"observation": "22C", "reward": 0, "done": False}, "id"),
    # webarena: {"env_idx": n} from /create, terminated/truncated instead of done.
    ("webarena", {"env_idx": 2}, {"observation": "Tab 0 ...", "sites": [], "object": {}},
     {"observation": "done", "reward": 1.0, "terminated": True, "truncated": False, "info": {}}, "idx"),
])
def test_env_idx_family_every_shape(env, create, reset, step, expect_reset_field):
    async def scenario():
        routes = {"/create": lambda b, q: create, "/reset": lambda b, q: reset, "/step": lambda b, q: step,
                  "/observation": lambda b, q: "the page", "/close": lambda b, q: (404, {"detail": "Not Found"})}
        async with ScriptedServer(routes) as server:
            client = server.client(env)
            env_id = await client.create()
            first = await client.reset(env_id, 11)
            result = await client.step(env_id, "search[shoes]")
            observation = await client.observation(env_id)
            await client.close_quietly(env_id)  # this server has no /close: fine
            return env_id, first, result, observation, server.requests

    env_id, first, result, observation, requests = asyncio.run(scenario())
    assert env_id == (create if isinstance(create, int) else create["env_idx"])
    assert first.observation == (reset if isinstance(reset, str) else reset[0] if isinstance(reset, list)
                                 else reset["observation"])
    assert result.observation == step.get("state", step.get("observation"))
    assert result.reward == step["reward"] and result.done == bool(step.get("done") or step.get("terminated"))
    assert observation == "the page"
    assert requests[1][2][expect_reset_field] == 11 and requests[1][2]["env_idx"] == env_id
    assert requests[2][2] == {"env_idx": env_id, "action": "search[shoes]"}
    assert requests[3][1] == {"env_idx": str(env_id)}


def test_protocol_from_config_overrides_the_spec():
    assert spec_for("my_env").protocol == "id" and spec_for("my_env", "env_idx").protocol == "env_idx"
    assert spec_for("webshop", "id").task_field == "session_id"


class ScriptedPolicy:
    """Answers each turn with the next text of a script, as if the model had generated it."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts = tokenizer, list(texts)

    async def act(self, tokens, budget, env_id):
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False)
        return Turn(Generation(ids, [-0.1] * len(ids), "stop"), version=3)


def run_scripted(tiny_model, env, routes, texts, template="raw", rewards=None, max_turns=4):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cfg = ActorConfig(max_turns=max_turns, max_tokens=60, max_seq_len=1000, rewards=rewards or {"env": 1.0})

    async def scenario():
        async with ScriptedServer(routes) as server:
            setup = EpisodeSetup(server.client(env), tokenizer, cfg, make_template(template), env)
            sample = await run_episode(setup, ScriptedPolicy(tokenizer, texts), task_idx=5)
            return sample, server.requests

    return asyncio.run(scenario())


def sciworld_routes(scores):
    scores = iter(scores)

    def step(b, q):
        score = next(scores)
        return {"observation": f"score now {score}", "reward": 0, "score": score, "done": score >= 100}
    return {"/create": lambda b, q: {"id": 1},
            "/reset": lambda b, q: {"task_name": "boil", "var_num": 0, "task_description": "Boil water.",
                                    "observation": "You are in the kitchen.", "reward": 0, "score": 0,
                                    "deleted": False, "done": False},
            "/step": step, "/close": lambda b, q: True}


def test_running_total_scores_become_per_turn_rewards_and_success(tiny_model):
    sample, _ = run_scripted(tiny_model, "sciworld", sciworld_routes([25, 25, 75, 100]),
                             ["look around\n", "open door\n", "go kitchen\n", "boil water\n"])
    assert sample.turn_rewards.tolist() == pytest.approx([0.25, 0.0, 0.5, 0.25])  # score 0-100, a running total
    assert sample.reward == pytest.approx(1.0) and sample.success and sample.finish_reason == "done"
    failed, _ = run_scripted(tiny_model, "sciworld", sciworld_routes([25, 50, 50, 50]), ["a\n"] * 4)
    assert failed.reward == pytest.approx(0.5) and not failed.success and failed.finish_reason == "max_turns"


def test_react_actions_and_the_invalid_action_convention(tiny_model):
    routes = {"/create": lambda b, q: {"id": 0},
              "/reset": lambda b, q: {"observation": "Your goal: go to the red ball", "reward": 0, "score": 0,
                                      "deleted": False, "done": False},
              "/step": lambda b, q: {"observation": "The task is completed.", "reward": 0.9, "score": 0.9,
                                     "done": True},
              "/close": lambda b, q: True}
    texts = ["Thought: hmm, no action here\n",
             "Thought: the ball is ahead.\nAction: go to red ball 1!\n"]
    sample, requests = run_scripted(tiny_model, "babyai", routes, texts, template="react",
                                    rewards={"env": 1.0, "format": 0.5})
    steps = [body for path, _, body in requests if path == "/step"]
    assert steps == [{"id": 0, "action": "go to red ball 1"}]  # the invalid turn made no call; "!" cleaned
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    context = tokenizer.decode(sample.tokens[~sample.loss_mask.astype(bool)].tolist())
    assert "Invalid Action.\n\nYour goal: go to the red ball" in context  # and the last observation again
    assert sample.invalid_actions == 1 and sample.num_turns == 2
    assert sample.turn_rewards.tolist() == pytest.approx([0.0, 0.9])
    assert sample.reward == pytest.approx(0.9 + 0.5 * 0.5) and sample.success  # env + half the turns parsed
