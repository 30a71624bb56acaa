"""Runs inside vLLM's worker process (named by `worker_extension_cls`): loads new weights
in place without restarting the engine, from a safetensors file (the blob transport's, or
the one the actor staged from a broadcast).

Tensors cannot travel through `collective_rpc` on the CPU build, so the actor passes a
path; the CPU backend repacks linear weights, so
`model_runner.reload_weights` (which redoes that processing) is used rather than
`model.load_weights`.

It returns how many output tokens each request in the worker holds (its id as the caller
gave it: vLLM adds "-" and 8 random characters): with generation paused and the requests
kept, that is where each request's tokens switch from the old weights to the new.
"""

from __future__ import annotations


class WeightReloadExtension:
    def omrl_reload_weights(self, path: str) -> dict[str, int]:
        from safetensors.torch import load_file

        self._omrl_reload(iter(load_file(path).items()))
        return {request_id.rsplit("-", 1)[0]: len(state.output_token_ids)
                for request_id, state in self.model_runner.requests.items()}

    def _omrl_reload(self, weights) -> None:
        """Reload in place; then an output layer tied to the embedding, which got no weights of
        its own, redoes its processing (the CPU build packs the output layer's matrix once: left
        alone, it would go on computing logits from the old embedding)."""
        self.model_runner.reload_weights(weights_iterator=weights)
        model = self.model_runner.get_model()
        head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is not None and embed is not None and head.weight.data_ptr() == embed.weight.data_ptr():
            head.quant_method.process_weights_after_loading(head)
