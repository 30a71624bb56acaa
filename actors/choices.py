"""A turn decoded as one of a list of token sequences (`actor.constrain_actions`).

The episode loop asks the env for the actions it admits now (`/actions`), writes each as the
model would (`TurnFormat.agent_turn`: its tokens and the end of turn), and the engine masks
every token that would leave those sequences: the model's own distribution, renormalised over
the tokens that keep the turn on one of them. `ChoiceTrie` is that rule; in vLLM,
`actors.vllm_choices.ChoiceLogitsProcessor` applies it to each request that carries choices.
"""

from __future__ import annotations

EXTRA_ARG = "omrl_choices"  # the key of SamplingParams.extra_args that carries a request's choices


class ChoiceTrie:
    """Token sequences as a prefix tree: which tokens may follow a prefix."""

    def __init__(self, choices: list[list[int]]):
        if not choices or not all(choices):
            raise ValueError("choices must be a non-empty list of non-empty token sequences")
        self.root: dict[int, dict] = {}
        for sequence in choices:
            node = self.root
            for token in sequence:
                node = node.setdefault(token, {})

    def allowed(self, prefix: list[int]) -> list[int] | None:
        """The tokens that continue `prefix` along a choice; None once it has left them or a choice
        is complete (the turn has ended: nothing to mask)."""
        node = self.root
        for token in prefix:
            node = node.get(token)
            if node is None:
                return None
        return list(node) or None

    def along(self, ids: list[int]) -> list[list[int]]:
        """The tokens the mask allowed at each of `ids` (a turn decoded under it): [] once the turn
        has left the choices or completed one, where the engine masks nothing. What the learner
        renormalises each token's distribution over (Sample.allowed)."""
        out: list[list[int]] = []
        node: dict[int, dict] | None = self.root
        for token in ids:
            out.append(list(node) if node else [])
            node = node.get(token) if node else None
        return out


def continued(choices: list[list[int]], generated: list[int]) -> list[list[int]]:
    """The rest of each choice that begins with `generated` (the turn's tokens before an update
    interrupted it): a continued request's choices; the choices themselves before any token (a
    turn's first request, every turn: no copy)."""
    if not generated:
        return choices
    n = len(generated)
    return [choice[n:] for choice in choices if choice[:n] == generated and len(choice) > n]
