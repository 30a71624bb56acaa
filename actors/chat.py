"""How an episode's text becomes context tokens: the model's chat template, or plain text.

The episode loop asks for two things, and appends what it gets with mask 0:
`first_prompt(system, observation)`, the tokens before the first generation, and
`next_turn(generated_ids, observation)`, the tokens between one generation and the next.
Generated tokens stay exactly as sampled; neither format ever re-tokenises them.

`ChatFormat` renders with `tokenizer.apply_chat_template`. What it appends between turns is
cut from renders of a fixed conversation (u, a: a user and an assistant message of one-token
contents), each against the fixed prefix before it, as prime-rl's renderers cut messages:

    between turns     render([u, a, user(obs)], generation prompt)
                      minus render([u], generation prompt) and a's content: a's end as history
                      and the new user turn, e.g. ChatML "<|im_end|>\n<|im_start|>user\nobs
                      <|im_end|>\n<|im_start|>assistant\n"; only what the model did not
                      generate itself is appended (its end-of-turn token is sampled)
    assistant suffix  the head of that which closes a's content: what render([u, a]) ends with
                      after a's content (ChatML "<|im_end|>\n"); its first token is the one the
                      model stops on

An assistant message is only ever cut as history (followed by a user turn), so a template
that renders the newest assistant message differently, as Qwen3's does (an empty <think>
block before the last turn's content, none for earlier turns), works: the episode's tokens
equal the template's render of the whole conversation up to each generation prompt whenever
the model's turns are the canonical tokens of their text plus the end-of-turn token. Tokens
a model generates (a <think> block included) stay in the buffer as sampled and are what it
sees on later turns: Qwen3's template would drop earlier turns' reasoning from a re-render,
but an append-only buffer keeps it, so the learner scores exactly the context each turn was
sampled in. A template whose renders are not prefixes of each other (one that rewrites
earlier turns) is refused at construction, naming the tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

# The fixed conversation the template's pieces are cut from (content tokenised on its own).
_USER, _ASSISTANT = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}


class TurnFormat(Protocol):
    def first_prompt(self, system: str, observation: str) -> list[int]: ...

    def next_turn(self, generated_ids: list[int], observation: str) -> list[int]: ...

    def agent_turn(self, text: str) -> list[int]:
        """The tokens a model that wrote `text` as its turn samples: the text's canonical tokens
        and the end of turn it stops on (what oracle and imported trajectories are trained on)."""


_PROBE = "Say x.\n  The   door (2 steps) <|im_end|>\u00e9t\u00e9 \u4f60\u597d 12345 \tend"


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """`tokenizer.encode(text, add_special_tokens=False)`, through the Rust tokenizer itself
    where the tokenizer is a fast one that encodes the same: Hugging Face's path batches one
    text through a thread pool, and in an actor that shares its GIL with vLLM's front end each
    call cost about 200 us (x1.11 the default episode loop's tokens/s without it)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    slow = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    if backend is None or not callable(getattr(backend, "encode", None)):
        return slow
    fast = lambda text: backend.encode(text, add_special_tokens=False).ids  # noqa: E731
    try:
        same = fast(_PROBE) == slow(_PROBE)
    except Exception:  # noqa: BLE001 - any surprise: the tokenizer's own path
        same = False
    return fast if same else slow


class PlainFormat:
    """No template: the system text, then the first observation, then each later observation
    as it comes, each encoded without special tokens."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self._encode = text_encoder(tokenizer)

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
        self._encode = text_encoder(tokenizer)
        self._prompt = self._render([_USER], generation_prompt=True)
        self._content = self._encode(_ASSISTANT["content"])
        # A template that breaks the prefix assumptions fails here, at start.
        self.assistant_suffix = self._assistant_suffix(self._after_content("z"))

    def first_prompt(self, system: str, observation: str) -> list[int]:
        # The plain prompt's line break before the observation is the template's job here.
        system = system.rstrip("\n")
        messages = [{"role": "system", "content": system}] if system else []
        return self._render([*messages, {"role": "user", "content": observation}], generation_prompt=True)

    def next_turn(self, generated_ids: list[int], observation: str) -> list[int]:
        after = self._after_content(observation)
        return self._missing_suffix(generated_ids) + self._rest(after, self.assistant_suffix, "a new user turn")

    def agent_turn(self, text: str) -> list[int]:
        """The text's tokens and the first token of the assistant suffix (ChatML: <|im_end|>, the
        tiny template: "\\n"), where the model stops; the rest of the suffix is context."""
        return self._encode(text) + self.assistant_suffix[:1]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
        # As apply_chat_template(tokenize=True) encodes its render, without its batching.
        return self._encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                               tokenize=False))

    def _rest(self, whole: list[int], prefix: list[int], what: str) -> list[int]:
        if whole[:len(prefix)] != prefix:
            raise ValueError(f"the chat template of tokenizer {self.name!r} does not render {what} as an "
                             f"extension of the conversation before it, so turns cannot be appended token-exactly; "
                             f"set actor.chat_template=\"none\" or give the model a template that only appends")
        return whole[len(prefix):]

    def _after_content(self, observation: str) -> list[int]:
        """What follows an assistant message's content, as history, up to the next generation: its
        end and a user turn carrying `observation`, with the generation prompt."""
        turn = self._render([_USER, _ASSISTANT, {"role": "user", "content": observation}], generation_prompt=True)
        return self._rest(self._rest(turn, self._prompt, "an assistant message"), self._content,
                          "an assistant message's content")

    def _assistant_suffix(self, after: list[int]) -> list[int]:
        """The head of `after` that closes an assistant message's content: the longest one that
        render([u, a]) ends with, right after a's content (ChatML: <|im_end|> and "\\n")."""
        last = self._render([_USER, _ASSISTANT])
        for k in range(len(after), 0, -1):
            if last[-k - len(self._content):] == self._content + after[:k]:
                return after[:k]
        # No end-of-turn marker at all, or the newest message's end differs from its end as history.
        return self._rest(last[-len(self._content):], self._content, "an assistant message's end")

    def _missing_suffix(self, generated_ids: list[int]) -> list[int]:
        """What of the assistant suffix the generation did not end with: the longest head of the
        suffix that the generation ends with was sampled; the rest is added."""
        suffix = self.assistant_suffix
        for k in range(len(suffix), 0, -1):
            if generated_ids[-k:] == suffix[:k]:
                return suffix[k:]
        return list(suffix)


def make_format(tokenizer, chat_template: Literal["auto", "none"], stop: list[str] | tuple[str, ...] = ()
                ) -> TurnFormat:
    """actor.chat_template: auto uses the tokenizer's template where it has one; `stop` (actor.stop)
    ends a plain-text turn."""
    # Tokenizers that are not Hugging Face's (vLLM's Mistral one) may have no such attribute.
    if chat_template == "auto" and getattr(tokenizer, "chat_template", None):
        return ChatFormat(tokenizer)
    return PlainFormat(tokenizer, stop)
