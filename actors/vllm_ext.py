"""Runs inside vLLM's worker process (named by `worker_extension_cls`): loads new weights
in place without restarting the engine, from a safetensors file (blob transport) or from
the learner over a torch.distributed group (broadcast transport).

Tensors cannot travel through `collective_rpc` on the CPU build, so the actor passes a
path or has the worker receive them itself; the CPU backend repacks linear weights, so
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

    def omrl_join(self, host: str, port: int, link: str, world: int, backend: str, timeout_s: float) -> None:
        """Join the learner's group `link` as rank 1 + this worker's tensor-parallel rank (a
        group joined before is left: the learner restarted or dropped it)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from common.weight_sync import open_group, open_store

        self._omrl_group = None
        store = open_store(host, port, timeout_s)
        self._omrl_group = open_group(store, link, 1 + get_tensor_model_parallel_rank(), world, backend, timeout_s)

    def omrl_receive(self) -> int:
        """Receive one version bucket by bucket straight into the model; its number. A
        failure leaves the group (the actor joins again) and the weights part-loaded (the
        actor generates nothing until a version loads whole)."""
        from common.weight_sync import receive_version

        group = getattr(self, "_omrl_group", None)
        if group is None:
            raise RuntimeError("no weight group joined: omrl_join first")
        try:
            version, tensors = receive_version(group, self.model_runner.device)
            self._omrl_reload(tensors)
            for _ in tensors:  # the model took what it needed; the group must see every bucket
                pass
        except BaseException:
            self._omrl_group = None
            raise
        return version
