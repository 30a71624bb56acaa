"""Runs inside vLLM's worker process (named by `worker_extension_cls`): loads new weights
in place without restarting the engine, from a safetensors file (the blob transport's, or
the one the actor staged from a broadcast).

Tensors cannot travel through `collective_rpc` on the CPU build, so the actor passes a
path; the CPU backend repacks linear weights, so
`model_runner.reload_weights` (which redoes that processing) is used rather than
`model.load_weights`.
"""

from __future__ import annotations


class WeightReloadExtension:
    def omrl_reload_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        state = load_file(path)
        self._omrl_reload(iter(state.items()))
        return len(state)

    def _omrl_reload(self, weights) -> None:
        """Reload in place; then an output layer tied to the embedding, which got no weights of
        its own, redoes its processing (the CPU build packs the output layer's matrix once: left
        alone, it would go on computing logits from the old embedding)."""
        self.model_runner.reload_weights(weights_iterator=weights)
        model = self.model_runner.get_model()
        head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is not None and embed is not None and head.weight.data_ptr() == embed.weight.data_ptr():
            head.quant_method.process_weights_after_loading(head)
