"""`omrl plan`: will the config fit on a node of N GPUs? The learner's and the vLLM engines'
memory per GPU, estimated from the config and the model's config.json (deploy/plan.py)."""

from __future__ import annotations

import argparse
import json
import sys

from common.cli import add_config_args


def add_args(p: argparse.ArgumentParser) -> None:
    p.description = ("The per-GPU memory of the learner (weights, gradients, AdamW, a KL reference, a micro-batch's "
                     "activations) and of each actor's vLLM (weights, the KV cache its concurrency needs), and "
                     "what to change where it does not fit. Estimates from config.json: nothing is loaded. "
                     "Exit code 0 when everything fits (a KV cache short of the worst case included: vLLM then "
                     "preempts), 1 when something does not fit, 2 on a bad config or model.")
    add_config_args(p)
    p.add_argument("--model", help="model.path: a local model directory with config.json")
    p.add_argument("--gpus", type=int, default=1, help="GPUs on the node (0: the CPU; default 1)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GB (default 80)")
    p.add_argument("--json", action="store_true", help="the plan as JSON")


def main(args: argparse.Namespace) -> int:
    from common.cli import config_from_args
    from deploy.plan import plan, render

    if args.gpus < 0 or args.gpu_memory_gb <= 0:
        print("error: --gpus must be 0 or more and --gpu-memory-gb above 0", file=sys.stderr)
        return 2
    cfg = config_from_args(args, {"model.path": args.model})
    try:
        result = plan(cfg, args.gpus, args.gpu_memory_gb)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=2) if args.json else render(result))
    return 0 if result.fits else 1
