"""`omrl export RUN_DIR OUT`: a run's trained policy as a Hugging Face model directory
(`save_pretrained`: config, safetensors weights, generation config, tokenizer) that
transformers and vLLM load as they load the base model.

The weights are the newest checkpoint's (or step N's), in fp32 as the learner keeps them;
the architecture and the tokenizer come from the base model the run's config.toml names.
Every refusal (no config.toml, OUT not empty, no such checkpoint) comes before a checkpoint
is read, and OUT appears only whole: it is written beside and renamed into place.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from common.config import ConfigError, load_config
from common.models import save_policy

log = logging.getLogger("omrl.export")

MANIFEST = "omrl_export.json"


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the policy of `run_dir`'s newest checkpoint (or step `step`'s) to `out`; returns `out`."""
    run_dir, out = Path(run_dir), Path(out)
    base = _base_model(run_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"error: {out} exists and is not an empty directory: name a new one")
    checkpoint = _checkpoint(run_dir / "checkpoints", step)

    from learner.checkpoint import read_model, read_state
    from learner.trainer import PREFIX

    state = read_state(checkpoint)
    model = _policy(base, read_model(checkpoint, PREFIX), checkpoint)  # the policy's tensors only
    manifest = {"run_dir": str(run_dir.resolve()), "checkpoint": checkpoint.name, "step": state.step,
                "weight_version": state.version, "groups_trained": state.groups_trained, "base_model": base}
    save_policy(model, base, out, files={MANIFEST: json.dumps(manifest, indent=2) + "\n"})  # whole or not at all
    log.info("exported step %d (weight version %d) of %s to %s", state.step, state.version, run_dir, out)
    return out


def _base_model(run_dir: Path) -> str:
    """model.path of the run's config.toml (the run's own resolved config, environment left out)."""
    path = run_dir / "config.toml"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist: RUN_DIR must be a run directory that `omrl run` wrote")
    try:
        cfg = load_config(path, environ={})
    except ConfigError as exc:
        raise SystemExit(f"error: {path}: {exc}") from None
    if not cfg.model.path:
        raise SystemExit(f"error: {path} names no model.path: the base model is needed for its architecture "
                         f"and tokenizer; add it under [model]")
    return cfg.model.path


def _checkpoint(directory: Path, step: int | None) -> Path:
    from learner.checkpoint import checkpoint_path, checkpoints, latest_checkpoint

    newest = latest_checkpoint(directory)
    if newest is None:
        raise SystemExit(f"error: no checkpoint in {directory}: the run has not written one yet "
                         f"(learner.checkpoint_every steps)")
    if step is None:
        return newest
    path = checkpoint_path(directory, step)
    if path not in checkpoints(directory):
        kept = ", ".join(p.name for p in checkpoints(directory))
        raise SystemExit(f"error: no checkpoint of step {step} in {directory} (there are {kept}; "
                         f"learner.keep_checkpoints says how many are kept)")
    return path


def _policy(base: str, model_state: dict, checkpoint: Path):
    """The base architecture in fp32 holding the checkpoint's weights (the learner's names less `lm.`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from learner.trainer import PREFIX

    config = AutoConfig.from_pretrained(base)
    # No weights of its own: the checkpoint's tensors become its parameters (assign=True), so
    # nothing is initialised at random and the weights are in memory once.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        # vLLM's default sampling parameters come from it (Qwen's instruct models set top_p, eos ids...).
        model.generation_config = GenerationConfig.from_pretrained(base)
    except OSError:  # the base has no generation_config.json: keep the one derived from the config
        pass
    if not model_state:
        raise SystemExit(f"error: {checkpoint} holds no policy weights (named {PREFIX}...): not a learner "
                         f"checkpoint of this version")
    state = {k[len(PREFIX):]: v.float() for k, v in model_state.items()}  # fp32 already, as the learner keeps it
    head = _weight_name(model, model.get_output_embeddings())
    tied = model.config.tie_word_embeddings
    if tied and head in state:
        # The learner shares the one tensor; a checkpoint holds it under both names or only the input one.
        embed = _weight_name(model, model.get_input_embeddings())
        if not torch.equal(state[head], state[embed]):
            raise SystemExit(f"error: {checkpoint}: {head} differs from {embed} although the model ties them "
                             f"(tie_word_embeddings): the learner untied them; exporting either would lose training")
        del state[head]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (tied and k == head)]
    if missing or unexpected:
        raise SystemExit(f"error: {checkpoint} does not fit {base}'s architecture: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    if tied:
        model.tie_weights()  # the output layer becomes the input embedding again
    unset = [k for k, v in model.state_dict().items() if v.is_meta]
    if unset:
        raise SystemExit(f"error: {checkpoint} leaves {unset[:3]} of {base}'s architecture unset")
    # Only what save_pretrained writes is set: non-persistent buffers (rotary frequencies) stay on
    # the meta device, so this model is for saving, not for running.
    return model


def _weight_name(model, layer) -> str:
    """The state-dict name of `layer`'s weight inside `model`."""
    return next(f"{name}.weight" for name, module in model.named_modules() if module is layer)

