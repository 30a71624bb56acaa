"""A complete AgentGym "id"-protocol env server in the standard library: guess a digit.

    python examples/own-server/server.py --port 36001

Task i hides the digit i % 10; each answer gets `higher`, `lower` or `right` (reward 1, done).
"""

import argparse
import itertools
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

ENVS: dict[int, dict] = {}  # instance id -> {"secret", "observation"}; one instance per client
IDS = itertools.count()


def step(env: dict, action: str) -> dict:
    guess = action.strip()[:1]
    if not guess.isdigit():
        env["observation"] = "say one digit"
    else:
        env["observation"] = "right" if int(guess) == env["secret"] else "higher" if int(guess) < env["secret"] else "lower"
    right = env["observation"] == "right"
    return {"observation": env["observation"], "reward": float(right), "done": right, "success": right}


class Handler(BaseHTTPRequestHandler):
    def answer(self, body, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/":
            return self.answer("ok: guess-a-digit")
        env = ENVS.get(int(parse_qs(url.query).get("id", ["-1"])[0]))
        if url.path != "/observation" or env is None:
            return self.answer({"error": f"no such route or env: {self.path}"}, 404)
        self.answer(env["observation"])

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/create":
            env_id = next(IDS)
            ENVS[env_id] = {"secret": 0, "observation": ""}
            return self.answer({"id": env_id})
        env = ENVS.get(body.get("id"))
        if env is None:
            return self.answer({"error": f"no env with id {body.get('id')}"}, 404)
        if self.path == "/reset":
            env.update(secret=body["data_idx"] % 10, observation="guess a digit")
            return self.answer({"id": body["id"], "observation": env["observation"], "reward": 0.0, "done": False})
        if self.path == "/step":
            return self.answer(step(env, body["action"]))
        if self.path == "/close":
            return self.answer(ENVS.pop(body["id"]) is not None)
        self.answer({"error": f"no route {self.path}"}, 404)

    def log_message(self, *args) -> None:  # quiet: one line per request is too many
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=36001)
    args = parser.parse_args()
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
