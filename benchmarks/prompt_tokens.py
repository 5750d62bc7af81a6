"""How long a real Qwen model's prompts are: token counts of the memory-window prompts at H = 2 and H = 4,
through the Qwen2.5 tokenizer and its chat template, over real ALFWorld games and WebShop goals.

    python benchmarks/prompt_tokens.py [--games 24] [--steps 50] [--tokenizer ../shared/data/qwen2.5-tokenizer]

Each game is played by a random player over the admissible actions (up to --steps steps, ALFWorld's 50, WebShop's
30), as the training rollout builds its prompts (the environment's template, the memory window, no budget);
prints mean / p95 / max prompt tokens per environment and H, and the share over 4096 (the released
max_prompt_length).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from transformers import AutoTokenizer

from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import make_env_batch
from hgpo_trl.rollout.generation import control_text_guard, encode_prompt
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, run_rollout

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def random_player(seed: int):
    rng = random.Random(seed)

    def play(prompts, infos):
        return [Completion(text=rng.choice(info.get("admissible_actions") or ["look"])) for info in infos]

    return play


def prompt_lengths(factory, tasks, tokenizer, history_length: int, steps: int, workers: int) -> list[int]:
    """Token counts of every prompt of one random episode per task."""
    settings = RolloutSettings(history_length=history_length, max_steps=steps, action_mode="plain",
                               escape_text=control_text_guard(tokenizer), format_instruction="")
    envs = make_env_batch(factory, len(tasks), workers)
    prompts = []
    play = random_player(0)

    def player(texts, infos):
        prompts.extend(texts)
        return play(texts, infos)

    try:
        run_rollout(envs, tasks, 1, player, settings, scripted=True)
    finally:
        envs.close()
    return [len(encode_prompt(tokenizer, p)) for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=24, help="games (ALFWorld) / goals (WebShop) per environment")
    parser.add_argument("--steps", type=int, default=50, help="step limit for ALFWorld (WebShop: 30)")
    parser.add_argument("--tokenizer", default=str(SHARED / "qwen2.5-tokenizer"))
    parser.add_argument("--alfworld", default=os.environ.get("ALFWORLD_DATA") or str(SHARED / "alfworld"))
    parser.add_argument("--workers", type=int, default=2, help="ALFWorld worker processes")
    options = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(options.tokenizer)
    print(f"tokenizer {options.tokenizer} ({len(tokenizer)} tokens); random player; {options.games} games each")
    print(f"{'environment':<22}{'H':>3}{'prompts':>9}{'mean':>8}{'p95':>8}{'max':>8}{'> 4096':>9}")
    with tempfile.TemporaryDirectory() as cache:
        environments = []
        if Path(options.alfworld).is_dir():
            for split in ("valid_seen", "valid_unseen"):
                tasks = list(make_tasks("alfworld", split, data_path=options.alfworld, seed=0,
                                        num_tasks=options.games // 2))
                # Worker processes (spawn) need a picklable factory.
                factory = partial(make_env, "alfworld", split=split, data_path=options.alfworld, cache_dir=cache)
                environments.append((f"alfworld {split}", factory, tasks, options.steps, options.workers))
        else:
            print(f"(no ALFWorld games at {options.alfworld}: skipped)")
        environments.append(("webshop (generated)", partial(make_env, "webshop"),
                             list(make_tasks("webshop", "test", num_tasks=options.games)), 30, 0))
        for name, factory, tasks, steps, workers in environments:
            for history_length in (2, 4):
                lengths = np.array(prompt_lengths(factory, tasks, tokenizer, history_length, steps, workers))
                print(f"{name:<22}{history_length:>3}{len(lengths):>9}{lengths.mean():>8.0f}"
                      f"{np.percentile(lengths, 95):>8.0f}{lengths.max():>8}{np.mean(lengths > 4096):>9.1%}")


if __name__ == "__main__":
    main()
