"""Which visible GPU each engine uses on one machine: the learner's ranks take the first ones, actor
i (with actor.gpu_by_index) the i-th of the rest, round robin, and the evaluator those left over
after the actors, or none. deploy/plan.py draws the same placement."""

from __future__ import annotations

import os


def visible_gpus() -> list[str]:
    """The ids CUDA_VISIBLE_DEVICES lists, or every GPU torch sees where it is unset."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    return [v.strip() for v in visible.split(",") if v.strip()]


def gpu_for(index: int, learner_ranks: int, visible: list[str]) -> str:
    """The visible GPU actor `index` uses: one the learner's ranks leave free where there is one."""
    free = visible[learner_ranks:] or visible
    return free[index % len(free)]


def evaluator_gpus(learner_ranks: int, num_actors: int, tensor_parallel: int, visible: list[str]) -> list[str] | None:
    """The GPUs the evaluator's engine gets (actor.tensor_parallel_size of them): the first that no
    learner rank and no actor uses (the actors' `tensor_parallel` each after the learner's, or
    all on the first), or None when there are not enough."""
    free = visible[learner_ranks:]
    first = num_actors * tensor_parallel
    return free[first:first + tensor_parallel] if len(free) >= first + tensor_parallel else None


def evaluator_devices(cfg) -> str | None:
    """What CUDA_VISIBLE_DEVICES the evaluator of config `cfg` gets: "" where it runs on the CPU
    (no GPU visible, or learner.device = "cpu": nothing to narrow), the GPUs `evaluator_gpus`
    leaves it, or None where the learner's ranks and the actors leave it none."""
    if cfg.learner.device == "cpu":
        return ""
    visible = visible_gpus()
    if not visible:
        return ""
    gpus = evaluator_gpus(cfg.learner.ranks, cfg.actor.num_actors, cfg.actor.tensor_parallel_size, visible)
    return ",".join(gpus) if gpus is not None else None
