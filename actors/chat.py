"""How an episode's text becomes context tokens: the model's chat template, or plain text.

The episode loop asks for two things, and appends what it gets with mask 0:
`first_prompt(system, observation)`, the tokens before the first generation, and
`next_turn(generated_ids, observation)`, the tokens between one generation and the next.
Generated tokens stay exactly as sampled; neither format ever re-tokenises them.

`ChatFormat` renders with `tokenizer.apply_chat_template`. The pieces it appends between
turns are differences of renders of a fixed conversation, computed from the template itself:

    assistant suffix  render([u, a]) minus (render([u], generation prompt) + a's content)
                      e.g. ChatML "<|im_end|>\\n"; only the part the model did not generate
                      itself is appended (all of it after a generation cut by length)
    user turn         render([u, a, user(obs)], generation prompt) minus render([u, a])
                      e.g. ChatML "<|im_start|>user\\nobs<|im_end|>\\n<|im_start|>assistant\\n"

so the episode's tokens equal the template's render of the whole conversation whenever the
model's turns are the canonical tokens of their text plus the end-of-turn token(s). A template
whose renders are not prefixes of each other (one that rewrites earlier turns) is refused at
construction, naming the tokenizer.
"""

from __future__ import annotations

from typing import Literal, Protocol

# The fixed conversation the template's pieces are cut from (content tokenised on its own).
_USER, _ASSISTANT = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}


class TurnFormat(Protocol):
    def first_prompt(self, system: str, observation: str) -> list[int]: ...

    def next_turn(self, generated_ids: list[int], observation: str) -> list[int]: ...

    def agent_turn(self, text: str) -> list[int]:
        """The tokens a model that wrote `text` as its turn samples: the text's canonical tokens
        and the end of turn it stops on (what oracle and imported trajectories are trained on)."""


class PlainFormat:
    """No template: the system text, then the first observation, then each later observation
    as it comes, each encoded without special tokens."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def first_prompt(self, system: str, observation: str) -> list[int]:
        return self._encode(system + observation)

    def next_turn(self, generated_ids: list[int], observation: str) -> list[int]:
        return self._encode(observation)

    def agent_turn(self, text: str) -> list[int]:
        """The text and the first stop string (actor.stop), or the end-of-sequence token."""
        if self.stop:
            return self._encode(text + self.stop[0])
        return self._encode(text) + [self.tokenizer.eos_token_id]


class ChatFormat:
    """The tokenizer's chat template; see the module docstring."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.name = tokenizer.name_or_path or type(tokenizer).__name__
        self._base = self._render([_USER, _ASSISTANT])
        self.assistant_suffix = self._assistant_suffix()
        self._user_turn("x")  # a template that breaks the prefix assumptions fails here, at start

    def first_prompt(self, system: str, observation: str) -> list[int]:
        # The plain prompt's line break before the observation is the template's job here.
        system = system.rstrip("\n")
        messages = [{"role": "system", "content": system}] if system else []
        return self._render([*messages, {"role": "user", "content": observation}], generation_prompt=True)

    def next_turn(self, generated_ids: list[int], observation: str) -> list[int]:
        return self._missing_suffix(generated_ids) + self._user_turn(observation)

    def agent_turn(self, text: str) -> list[int]:
        """The text's tokens and the first token of the assistant suffix (ChatML: <|im_end|>, the
        tiny template: "\\n"), where the model stops; the rest of the suffix is context."""
        return self.tokenizer.encode(text, add_special_tokens=False) + self.assistant_suffix[:1]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                       tokenize=True, return_dict=False))

    def _rest(self, whole: list[int], prefix: list[int], what: str) -> list[int]:
        if whole[:len(prefix)] != prefix:
            raise ValueError(f"the chat template of tokenizer {self.name!r} does not render {what} as an "
                             f"extension of the conversation before it, so turns cannot be appended token-exactly; "
                             f"set actor.chat_template=\"none\" or give the model a template that only appends")
        return whole[len(prefix):]

    def _assistant_suffix(self) -> list[int]:
        """The template's tokens after an assistant message's content (ChatML: <|im_end|> and "\\n")."""
        prompt = self._render([_USER], generation_prompt=True)
        content = self.tokenizer.encode(_ASSISTANT["content"], add_special_tokens=False)
        return self._rest(self._rest(self._base, prompt, "an assistant message"), content, "an assistant message")

    def _missing_suffix(self, generated_ids: list[int]) -> list[int]:
        """What of the assistant suffix the generation did not end with: the longest head of the
        suffix that the generation ends with was sampled; the rest is added."""
        suffix = self.assistant_suffix
        for k in range(len(suffix), 0, -1):
            if generated_ids[-k:] == suffix[:k]:
                return suffix[k:]
        return list(suffix)

    def _user_turn(self, observation: str) -> list[int]:
        """A user turn carrying `observation`, and the generation prompt after it."""
        turn = self._render([_USER, _ASSISTANT, {"role": "user", "content": observation}], generation_prompt=True)
        return self._rest(turn, self._base, "a new user turn")


def make_format(tokenizer, chat_template: Literal["auto", "none"], stop: list[str] | tuple[str, ...] = ()
                ) -> TurnFormat:
    """actor.chat_template: auto uses the tokenizer's template where it has one; `stop` (actor.stop)
    ends a plain-text turn."""
    # Tokenizers that are not Hugging Face's (vLLM's Mistral one) may have no such attribute.
    if chat_template == "auto" and getattr(tokenizer, "chat_template", None):
        return ChatFormat(tokenizer)
    return PlainFormat(tokenizer, stop)
