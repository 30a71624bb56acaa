"""vLLM's side of `actor.constrain_actions` (actors/choices.py): a logits processor, loaded in the
engine's process (`logits_processors` in the engine arguments), that masks each request with
choices in its `extra_args` to the tokens that keep its output on one of them."""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from actors.choices import EXTRA_ARG, Choices


class ChoiceLogitsProcessor(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False  # greedy decoding is masked too

    def new_req_logits_processor(self, params):
        blob = (params.extra_args or {}).get(EXTRA_ARG)
        if not blob:
            return None
        cursor = Choices.from_bytes(blob).cursor()  # narrowed one token a step

        def mask(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            allowed = cursor.allowed(output_ids)
            if allowed is None:
                return logits
            index = torch.from_numpy(allowed.astype(np.int64)).to(logits.device)
            masked = torch.full_like(logits, float("-inf"))
            masked[index] = logits[index]
            return masked

        return mask
