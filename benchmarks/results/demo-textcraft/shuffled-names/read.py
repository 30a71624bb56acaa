"""Does a demo's SFT model read the recipes it is shown? From a demo's output directory DIR (after its
sft stage): the model plays the first N depth-1 train tasks greedily (transformers' generate, the
model's chat template, 12 turns, 40 tokens a turn) twice, in the game's names and with every task's
names shuffled (env.options.shuffle_names = 1), and prints the successes of each, with one shuffled
episode's turns.

    python benchmarks/results/demo-textcraft/shuffled-names/read.py DIR [N]
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.base import make_env
from envs.tasks import read_tasks


def play(tokenizer, model, env, task: int, turns: int = 12) -> tuple[bool, list[str]]:
    messages, lines = [{"role": "user", "content": env.reset(task)}], []
    lines.append(messages[0]["content"].splitlines()[-1])
    for _ in range(turns):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        action = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0].strip()
        result = env.step(action)
        lines.append(f"  {action} -> {result.observation[:90]}")
        messages += [{"role": "assistant", "content": action}, {"role": "user", "content": result.observation}]
        if result.done:
            return True, lines
    return False, lines


def main() -> None:
    out, n = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 30
    tokenizer = AutoTokenizer.from_pretrained(out / "sft")
    model = AutoModelForCausalLM.from_pretrained(out / "sft").eval()
    tasks = read_tasks(out / "tasks" / "depth-1" / "train.parquet", "textcraft")[:n]  # variant 0 of N goals
    for share in (0, 1):
        env = make_env("textcraft", shuffle_names=share)
        played = [play(tokenizer, model, env, task) for task in tasks]
        names = "shuffled names" if share else "the game's names"
        print(f"{names}: {sum(won for won, _ in played)} of {len(tasks)} solved")
        if share:
            print("\n".join(played[1][1]))


if __name__ == "__main__":
    main()
