"""Can the quickstart's model learn keydoor's decisions when each step gets a clean reward? A contextual bandit
outside the trainer, on the prompts the rollout builds along the winning path.

    python benchmarks/credit_probe.py --train_steps all            # entrance + room + hall + vault
    python benchmarks/credit_probe.py --train_steps entrance --keep_reward 0.5
    python benchmarks/credit_probe.py --warmstart outputs/learning/warmstart/seed0 --updates 150

Why: when RL on the quickstart does not learn, either the model cannot represent the rule within the budget, or
the advantages the rollouts give it do not carry the rule. This probe removes the second: every update samples
`num_generations` answers to each prompt of `tasks_per_device` training tasks and rewards each prompt on its own
(entrance: the gold key; vault, after the gold key: the gold door; room and hall: any valid answer), normalised
within the prompt's samples (GRPO's `mean_std_norm`, the library's own). The loss, AdamW, `learning_rate` and `max_grad_norm` are the trainer's.
`--keep_reward p` keeps each reward with probability p (the vault's coin flip seen from the entrance).

The config and any train.py option (e.g. `--learning_rate 3e-4`) set the model, the warm start, the prompts and
the batch, as for train.py. The model is `--warmstart` (a saved folder, e.g. a warm start of
benchmarks/learning.py) or, without it, the config's model warm-started here and saved under
`output_dir/warmstart`. Prints, every `--eval_every` updates, on the validation tasks (teacher-forced): the
share of tasks whose gold key scores above the other key, the share whose choice between the two keys is
confident (> 0.9), the mean probability of taking each key colour, and the mean probability of the right answer
at the room, hall and vault (after the gold key). Writes `output_dir/probe.json`. Figures: docs/results.md,
"The model can learn the game".

`--updates 0` only evaluates: it diagnoses a stalled run's checkpoint (a colour ranking instead of the rule):

    python benchmarks/credit_probe.py --warmstart outputs/quickstart/checkpoint-N --updates 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from hgpo_trl.advantages.groups import normalize_within
from hgpo_trl.commands.train import ConfigError, load_tasks, parse
from hgpo_trl.envs.keydoor import KeyDoorEnv, KeyDoorTask
from hgpo_trl.rollout.generation import encode_prompt, generate_completions
from hgpo_trl.rollout.memory import Memory, build_prompt

STEP_NAMES = ("entrance", "room", "hall", "vault")
TRAINED = {"entrance": ("entrance",), "decisions": ("entrance", "vault"), "all": STEP_NAMES}


def winning_path(
    task: dict[str, Any], history_length: int, format_instruction: str
) -> list[tuple[str, str, str]]:
    """(step name, prompt text, right answer) of the four steps of the task's winning path."""
    env, gold = KeyDoorEnv(), KeyDoorTask.from_row(task).gold
    observation, info = env.reset(task)
    memory, path = Memory(), []
    for step, (name, answer) in enumerate(
        zip(STEP_NAMES, (f"take {gold} key", "go to hall", "go to vault", f"open {gold} door"), strict=True)
    ):
        text, _ = build_prompt(
            env.render_prompt,
            info["task"],
            memory,
            observation,
            info["admissible_actions"],
            step,
            history_length,
            format_instruction,
        )
        path.append((name, text, answer))
        next_observation, *_, info = env.step(answer)
        memory.add(observation, answer)
        observation = next_observation
    return path


def other_colour(task: dict[str, Any]) -> str:
    t = KeyDoorTask.from_row(task)
    return t.color1 if t.gold == t.color2 else t.color2


def other_key(task: dict[str, Any]) -> str:
    return f"take {other_colour(task)} key"


def colour_choice(tasks: list[dict[str, Any]], p_gold: list[float]) -> dict[str, float]:
    """Per key colour, the mean probability that the entrance takes that key when it is one of the two: a model
    that ranks colours instead of reading the goal shows values far from 0.5."""
    choices: dict[str, list[float]] = {}
    for task, p in zip(tasks, p_gold, strict=True):
        choices.setdefault(task["gold"], []).append(p)
        choices.setdefault(other_colour(task), []).append(1.0 - p)
    return {colour: round(float(np.mean(ps)), 3) for colour, ps in sorted(choices.items())}


class Probe:
    def __init__(self, model, tokenizer, args, train_tasks, eval_tasks):
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.sampling = GenerationConfig(
            max_new_tokens=args.max_completion_length,
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=[self.eos],
        )
        instruction = args.rollout_settings().format_instruction
        self.paths = {}
        for task in [*train_tasks, *eval_tasks]:
            self.paths[task["task_id"]] = [
                (name, encode_prompt(tokenizer, text), answer)
                for name, text, answer in winning_path(task, args.history_length, instruction)
            ]

    def answer_ids(self, answer: str) -> list[int]:
        return self.tokenizer(answer, add_special_tokens=False)["input_ids"] + [self.eos]

    def logps(
        self, prompts: list[list[int]], completions: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed completion log-probabilities (teacher-forced, right-padded batch) and completion lengths."""
        rows = [p + c for p, c in zip(prompts, completions, strict=True)]
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        labels = torch.tensor(
            [
                [-100] * len(p) + c + [-100] * (width - len(p) - len(c))
                for p, c in zip(prompts, completions, strict=True)
            ]
        )[:, 1:]
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        token = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (token * (labels != -100)).sum(1), (labels != -100).sum(1)

    @torch.no_grad()
    def evaluate(self, tasks: list[dict[str, Any]]) -> dict[str, float]:
        self.model.eval()
        paths = [self.paths[t["task_id"]] for t in tasks]
        gold, _ = self.logps([p[0][1] for p in paths], [self.answer_ids(p[0][2]) for p in paths])
        other, _ = self.logps([p[0][1] for p in paths], [self.answer_ids(other_key(t)) for t in tasks])
        p_gold = torch.sigmoid(gold - other)  # the gold key's share of the two keys' probability
        result = {
            "entrance_acc": float((p_gold > 0.5).float().mean()),
            # A confident choice makes a task's rollouts agree: zero group variance, no advantage to unlearn it.
            "entrance_confident": float((torch.maximum(p_gold, 1 - p_gold) > 0.9).float().mean()),
            "entrance_colour_choice": colour_choice(tasks, p_gold.tolist()),
        }
        for index, name in enumerate(STEP_NAMES[1:], start=1):
            right, _ = self.logps([p[index][1] for p in paths], [self.answer_ids(p[index][2]) for p in paths])
            result[f"p_{name}"] = float(right.exp().mean())
        return result

    def update(
        self,
        tasks: list[dict[str, Any]],
        trained: tuple[str, ...],
        keep_reward: float,
        optimizer,
        rng: random.Random,
    ) -> dict[str, float]:
        """One AdamW step on `num_generations` samples of every trained prompt of `tasks`."""
        args, group = self.args, self.args.num_generations
        prompts = [
            (ids, answer) for t in tasks for name, ids, answer in self.paths[t["task_id"]] if name in trained
        ]
        sampled = [ids for ids, _ in prompts for _ in range(group)]
        self.model.eval()
        completions = generate_completions(
            self.model, self.sampling, sampled, self.tokenizer.pad_token_id, [self.eos]
        )
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = np.array(
            [
                float(text.strip() == prompts[i // group][1] and rng.random() < keep_reward)
                for i, text in enumerate(texts)
            ]
        )
        advantages = normalize_within(np.arange(len(sampled)) // group, rewards, "mean_std_norm")
        self.model.train()
        logp, lengths = self.logps(sampled, completions)
        loss = -(torch.tensor(advantages, dtype=torch.float32) * logp).sum() / lengths.sum()
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
        optimizer.step()
        return {"reward": float(rewards.mean()), "grad_norm": float(grad_norm)}


def load_warm_start(config_file: str, overrides: list[str], seed: int, folder: Path | None, output_dir: Path):
    """The model of `folder`, or the config's model warm-started as benchmarks/learning.py does it."""
    if folder is None:
        from benchmarks.learning import build_warm_start

        settings = {"config_file": config_file, "overrides": overrides, "iterations": 1}
        folder = Path(build_warm_start(settings, seed, output_dir / "warmstart")["path"])
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--config", default="configs/quickstart.yaml", help="train.py config (env_name: keydoor)"
    )
    parser.add_argument(
        "--train_steps",
        choices=list(TRAINED),
        default="all",
        help="prompts trained: entrance; entrance and vault (decisions); all four steps",
    )
    parser.add_argument("--keep_reward", type=float, default=1.0, help="probability that a reward is kept")
    parser.add_argument(
        "--updates", type=int, default=100, help="0 only evaluates the model (e.g. --warmstart a checkpoint)"
    )
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--warmstart", type=Path, help="a saved warm-started model (default: build one)")
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/credit_probe"))
    options, overrides = parser.parse_known_args(argv)
    if not 0.0 <= options.keep_reward <= 1.0:
        parser.error(f"--keep_reward must be in [0, 1], got {options.keep_reward}")
    if options.updates < 0 or options.eval_every < 1:
        parser.error("--updates must be >= 0 and --eval_every >= 1")
    if options.warmstart is not None and not (options.warmstart / "config.json").is_file():
        parser.error(f"--warmstart {options.warmstart}: not a saved model folder (no config.json)")
    try:
        env_args, args, _ = parse(
            ["--config", options.config, *overrides, "--output_dir", str(options.output_dir)]
        )
    except ConfigError as err:
        parser.error(f"configuration error: {err}")
    if args.env_name != "keydoor":
        parser.error(
            f"the probe knows keydoor's winning path only; {options.config} sets env_name {args.env_name!r}"
        )
    if env_args.eval_split is None:
        parser.error("the probe reports on validation tasks: eval_split must name a split")
    train_tasks = list(load_tasks(args, env_args, env_args.train_split, env_args.num_train_tasks))
    eval_tasks = list(load_tasks(args, env_args, env_args.eval_split, env_args.num_eval_tasks))
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model, tokenizer = load_warm_start(
        options.config, overrides, args.seed, options.warmstart, options.output_dir
    )
    probe = Probe(model, tokenizer, args, train_tasks, eval_tasks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    trained = TRAINED[options.train_steps]
    record = {
        "command": shlex.join(["python", "benchmarks/credit_probe.py", *argv]),
        "trained": list(trained),
        "keep_reward": options.keep_reward,
        "evals": [{"update": 0, **probe.evaluate(eval_tasks)}],
        "updates": [],
    }
    print(json.dumps(record["evals"][0]), flush=True)
    order: list[int] = []
    tick = time.time()
    for update in range(1, options.updates + 1):
        if len(order) < args.tasks_per_device:
            order += rng.sample(range(len(train_tasks)), len(train_tasks))
        tasks = [train_tasks[order.pop()] for _ in range(args.tasks_per_device)]
        record["updates"].append(
            {"update": update, **probe.update(tasks, trained, options.keep_reward, optimizer, rng)}
        )
        if update % options.eval_every == 0 or update == options.updates:
            record["evals"].append(
                {"update": update, **probe.evaluate(eval_tasks), "seconds": round(time.time() - tick, 1)}
            )
            print(json.dumps(record["evals"][-1]), flush=True)
    options.output_dir.mkdir(parents=True, exist_ok=True)
    (options.output_dir / "probe.json").write_text(json.dumps(record, indent=2))
    return record


if __name__ == "__main__":
    main()
