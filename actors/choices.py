"""A turn decoded as one of a list of token sequences (`actor.constrain_actions`).

The episode loop asks the env for the actions it admits now (`/actions`), writes each as the
model would (`TurnFormat.agent_turn`: its tokens and the end of turn), and the engine masks
every token that would leave those sequences: the model's own distribution, renormalised over
the tokens that keep the turn on one of them. `Choices` is that rule; in vLLM,
`actors.vllm_choices.ChoiceLogitsProcessor` applies it to each request that carries choices.

The sequences are one array, a row each, padded past its end: a TextCraft turn admits 66-1,187
actions (a `get` of 1 to 64 of each base item; 334 for the median goal), up to 6,000 tokens. Narrowing the rows token by
token is a few array operations; a prefix tree of dicts built for every request, and the choices
sent as nested lists (which vLLM walks int by int in each of its three processes), took most of
a masked evaluation's time (docs/results/textcraft-demo.md, section 21). Requests carry them as
bytes (`to_bytes`).
"""

from __future__ import annotations

import numpy as np

EXTRA_ARG = "omrl_choices"  # the key of SamplingParams.extra_args that carries a request's choices (bytes)
PAD = -1  # past the end of a row's sequence


class Choices:
    """Token sequences as rows of an array: which tokens may follow a prefix."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows  # int32 (choices, longest), PAD past each one's end

    @classmethod
    def of(cls, sequences: list[list[int]]) -> Choices:
        if not sequences or not all(sequences):
            raise ValueError("choices must be a non-empty list of non-empty token sequences")
        rows = np.full((len(sequences), max(map(len, sequences))), PAD, dtype=np.int32)
        for i, sequence in enumerate(sequences):
            rows[i, :len(sequence)] = sequence
        return cls(rows)

    def to_bytes(self) -> bytes:
        """The request's form (SamplingParams.extra_args): the shape, then the rows."""
        return np.array(self.rows.shape, dtype=np.int32).tobytes() + self.rows.tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Choices:
        n, width = np.frombuffer(blob[:8], dtype=np.int32)
        return cls(np.frombuffer(blob, dtype=np.int32, offset=8).reshape(n, width))

    def __len__(self) -> int:
        return len(self.rows)

    def sequences(self) -> list[list[int]]:
        return [[int(t) for t in row if t != PAD] for row in self.rows]

    def cursor(self) -> Cursor:
        return Cursor(self.rows)

    def allowed(self, prefix: list[int]) -> list[int] | None:
        """The tokens that continue `prefix` along a choice; None once it has left them or a choice
        is complete (the turn has ended: nothing to mask)."""
        allowed = self.cursor().allowed(prefix)
        return None if allowed is None else allowed.tolist()

    def along(self, ids: list[int]) -> list[list[int]]:
        """The tokens the mask allowed at each of `ids` (a turn decoded under it): [] once the turn
        has left the choices or completed one, where the engine masks nothing. What the learner
        renormalises each token's distribution over (Sample.allowed)."""
        cursor = self.cursor()
        out: list[list[int]] = []
        for k in range(len(ids)):
            allowed = cursor.allowed(ids[:k])
            out.append([] if allowed is None else allowed.tolist())
        return out

    def continued(self, generated: list[int]) -> Choices | None:
        """The rest of each choice that begins with `generated` (the turn's tokens before an update
        interrupted it): a continued request's choices; these choices themselves before any token (a
        turn's first request, every turn: no copy); None where no choice goes on past `generated`."""
        if not generated:
            return self
        n = len(generated)
        cursor = self.cursor()
        if cursor.allowed(generated) is None:
            return None
        rest = self.rows[cursor.live, n:]
        rest = rest[rest[:, 0] != PAD]
        return Choices(np.ascontiguousarray(rest[:, :int((rest != PAD).sum(1).max())]))


class Cursor:
    """The rows still on a turn's prefix, narrowed as its tokens come (the engine's per-request
    state: each decoding step adds one token)."""

    def __init__(self, rows: np.ndarray):
        self.table, self.live, self.depth = rows, np.arange(len(rows)), 0

    def allowed(self, prefix: list[int]) -> np.ndarray | None:
        """As `Choices.allowed`, for a prefix that extends the one before (as a request's output does,
        token by token); a shorter one starts over."""
        if len(prefix) < self.depth:
            self.live, self.depth = np.arange(len(self.table)), 0
        width = self.table.shape[1]
        while self.depth < len(prefix) and self.live.size:
            if self.depth >= width:
                self.live = self.live[:0]
                break
            self.live = self.live[self.table[self.live, self.depth] == prefix[self.depth]]
            self.depth += 1
        if not self.live.size or len(prefix) >= width:
            return None
        following = np.unique(self.table[self.live, len(prefix)])
        following = following[following != PAD]
        return following if following.size else None
