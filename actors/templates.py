"""Action templates: how the model writes an action, and how the actor reads it back.

    raw    the generated text is the action (the tiny model's envs)
    react  "Thought: ...\\nAction: ...": the text after the last `Action:`, to the end of its
           line, as AgentGym's clients split it
    tag    "<action>...</action>"
    json   a tool call: {"action": "..."} or {"name": "tool", "arguments": "..."}

`parse` returns the action, or None when the text does not parse; the episode then
follows AgentGym's convention: no server call, the observation "Invalid Action." and the
last observation, reward 0, counted (`actor/invalid_action_frac`). Adding a template is a
class with `parse` and `instructions`, and one decorator::

    @register_template("caps")
    class Caps(ActionTemplate):
        instructions = "Write your action in capitals."
        def parse(self, text): return text.strip().lower() if text.strip().isupper() else None
"""

from __future__ import annotations

import json
import re

from common.registry import Registry

INVALID_ACTION = "Invalid Action.\n\n"


class ActionTemplate:
    instructions = ""
    """A line for the prompt that says how to write an action."""

    def parse(self, text: str) -> str | None:
        raise NotImplementedError


TEMPLATES: Registry[type[ActionTemplate]] = Registry("action template", "actor.action_template")
register_template = TEMPLATES.register


def make_template(name: str) -> ActionTemplate:
    return TEMPLATES.lookup(name)()


@register_template("raw")
class Raw(ActionTemplate):
    def parse(self, text: str) -> str | None:
        return text


@register_template("react")
class ReAct(ActionTemplate):
    instructions = "Answer in the format:\nThought: <your thought>\nAction: <your action>"
    _action = re.compile(r"Action:[ \t]*([^\n]*)")

    def parse(self, text: str) -> str | None:
        found = self._action.findall(text)
        action = found[-1].strip() if found else ""
        return action or None


@register_template("tag")
class Tag(ActionTemplate):
    instructions = "Write your action between <action> and </action>."
    _action = re.compile(r"<action>(.*?)</action>", re.DOTALL)

    def parse(self, text: str) -> str | None:
        found = self._action.findall(text)
        action = found[-1].strip() if found else ""
        return action or None


@register_template("json")
class JsonCall(ActionTemplate):
    instructions = 'Write your action as JSON: {"action": "<your action>"}'

    def parse(self, text: str) -> str | None:
        start, end = text.find("{"), text.rfind("}")
        if start < 0 or end < start:
            return None
        try:
            call = json.loads(text[start:end + 1])
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict):
            return None
        if isinstance(call.get("action"), str) and call["action"].strip():
            return call["action"].strip()
        name, args = call.get("name"), call.get("arguments", "")
        if isinstance(name, str) and name.strip():
            args = args if isinstance(args, str) else " ".join(str(v) for v in args.values()) \
                if isinstance(args, dict) else ""
            return f"{name.strip()} {args.strip()}".strip()
        return None
