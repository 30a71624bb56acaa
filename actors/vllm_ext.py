"""Runs inside vLLM's worker process (named by `worker_extension_cls`): loads new weights
in place from a safetensors file, without restarting the engine.

Tensors cannot travel through `collective_rpc` on the CPU build, so the actor passes a
path; the CPU backend repacks linear weights, so `model_runner.reload_weights` (which
redoes that processing) is used rather than `model.load_weights`.
"""

from __future__ import annotations


class WeightReloadExtension:
    def omrl_reload_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        state = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))
        return len(state)
