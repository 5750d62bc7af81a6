"""`HGPOTrainer`: TRL's `GRPOTrainer` trained on per-step samples of multi-turn environment rollouts.

One iteration: each process plays its `tasks_per_device` tasks `num_generations` times (`hgpo_trl.rollout`),
every step becomes one (prompt, completion) sample with its own advantage (`hgpo_trl.advantages`), and the
parent's machinery (buffering, clipped loss, KL, optimizer, logging) trains on them. Only what per-step
samples require is overridden: the task dataloader, `_generate_and_score_completions`, `evaluate`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel
from transformers.integrations import TensorBoardCallback
from transformers.integrations.integration_utils import default_logdir
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl import GRPOTrainer
from trl.models.utils import unwrap_model_for_generation
from trl.trainer.utils import pad

from hgpo_trl.advantages import compute_advantages, hgpo_level_stats
from hgpo_trl.config import HGPOConfig
from hgpo_trl.diagnostics import Bias, advantage_bias
from hgpo_trl.envs import TextEnv, make_env
from hgpo_trl.envs.pool import EnvBatch, default_num_workers, make_env_batch
from hgpo_trl.envs.registry import is_fast_env
from hgpo_trl.generation import encode_prompt, generate_completions
from hgpo_trl.rollout import Completion, Rollout, run_rollout
from hgpo_trl.sampler import TaskSampler
from hgpo_trl.trajectories import rollout_records, write_records

STAGING_DIR = ".staging"  # checkpoints are written here, then renamed into output_dir

# The keys of the generation dict that GRPOTrainer's loss reads (tests/test_trainer_contract.py pins them).
LOSS_INPUT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                   "num_items_in_batch", "old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps",
                   "importance_sampling_ratio")


def env_reward(completions: list, **kwargs: Any) -> list[float]:
    """Placeholder reward function: GRPOTrainer requires one, but rewards come from the environment."""
    raise RuntimeError("env_reward is a placeholder: HGPOTrainer takes rewards from the environment")


def _save_in_memory_reference(model, processing_class, args: HGPOConfig) -> None:
    """TRL rebuilds the KL reference from `model.config._name_or_path`: a model built (or warm-started) in memory
    has none, so save its initial weights to `output_dir/reference_model` and point the config at them. A resumed
    run (`args.resume_from_checkpoint`) keeps the reference its start saved: the model passed in to resume is
    not the one the run started from."""
    if not isinstance(model, PreTrainedModel) or model.config._name_or_path:
        return  # a path, an id, or a PEFT model (whose disabled adapter is the reference)
    path = Path(args.output_dir) / "reference_model"
    if args.resume_from_checkpoint:
        if not (path / "config.json").is_file():
            raise ValueError(f"resume_from_checkpoint with beta={args.beta} and a model built in memory: the KL "
                             f"reference saved when the run started, {path}, is missing (resume into the run's "
                             "own output_dir)")
    else:
        state = PartialState()
        if state.is_main_process:
            model.save_pretrained(path)
            if processing_class is not None:  # a complete model folder: vLLM and evaluate.py can load it
                processing_class.save_pretrained(path)
        state.wait_for_everyone()
    model.config._name_or_path = str(path)


class HGPOTrainer(GRPOTrainer):
    """Train an LLM agent on a text environment with step-level advantages (HGPO, GiGPO, GRPO, ProGPO).

    Args:
        model: a model id, a path, or a `PreTrainedModel` (saved to a folder first when `beta > 0`: TRL rebuilds
            the reference model from `model.config._name_or_path`).
        args: an `HGPOConfig`.
        train_dataset: one row per task (what the environment's `reset(task)` takes, e.g. `hgpo_trl.envs.make_tasks`).
        eval_dataset: the fixed validation tasks of `evaluate()` (one rollout per task).
        env_factory: builds one environment; default `hgpo_trl.envs.make_env(args.env_name, **args.env_kwargs)`.
    """

    _tag_names: ClassVar[list[str]] = ["trl", "hgpo"]
    _name = "HGPO"

    def __init__(self, model, args: HGPOConfig, train_dataset: Dataset, eval_dataset: Dataset | None = None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None,
                 env_factory: Callable[[], TextEnv] | None = None):
        if not isinstance(args, HGPOConfig):
            raise ValueError(f"HGPOTrainer needs an HGPOConfig, got {type(args).__name__}")
        if not isinstance(train_dataset, Dataset):
            raise ValueError("train_dataset must be a datasets.Dataset with one row per task "
                             f"(e.g. hgpo_trl.envs.make_tasks(...)), got {type(train_dataset).__name__}")
        if args.beta != 0.0 and peft_config is None:
            _save_in_memory_reference(model, processing_class, args)
        super().__init__(model=model, reward_funcs=[env_reward], args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config)
        for callback in self.callback_handler.callbacks:
            # The writer opens at the first log: evaluate() before train() would otherwise put it in ./runs.
            if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
                callback.logging_dir = os.path.join(args.output_dir, default_logdir())
        self.env_factory = env_factory or partial(make_env, args.env_name, **(args.env_kwargs or {}))
        self.rollout_settings = args.rollout_settings()
        context = getattr(self.model.config, "max_position_embeddings", None)
        if self.rollout_settings.max_prompt_tokens is None and context and context > (args.max_completion_length or 0):
            # Prompts must leave room for the completion: fit them to the model's context by default.
            self.rollout_settings = dataclasses.replace(self.rollout_settings,
                                                        max_prompt_tokens=context - (args.max_completion_length or 0))
        self._env_workers = args.env_workers
        if self._env_workers is None:  # a slow environment gets a worker pool sized to this process's cores
            fast = env_factory is not None or is_fast_env(args.env_name)
            self._env_workers = 0 if fast else default_num_workers(self.accelerator.state.num_processes)
        self._envs: EnvBatch | None = None
        self.last_level_stats: list = []  # HGPO's level statistics of the last rollout (plots)
        self._sample_rng = np.random.default_rng(args.seed + self.accelerator.process_index)
        self._training_seconds = 0.0
        self._batch_seconds = 0.0
        self._iteration = 0
        self._faulty_streak = 0

    # ------------------------------------------------------------------ tasks
    def get_train_dataloader(self):
        return self._get_dataloader(dataset=self.train_dataset, description="Training",
                                    batch_size=self.args.tasks_per_device, sampler_fn=self._get_train_sampler,
                                    is_training=True)

    def _get_train_sampler(self, dataset=None) -> TaskSampler:
        return TaskSampler(dataset if dataset is not None else self.train_dataset,
                           tasks_per_iteration=self.args.tasks_per_device * self.accelerator.num_processes,
                           repeat=self.args.steps_per_generation * self.num_iterations,
                           shuffle=self.shuffle_dataset, seed=self.args.seed)

    # ------------------------------------------------------------------ rollouts
    def _environments(self) -> EnvBatch:
        """The process's environments, built once (worker processes start in seconds): one per rollout of an
        iteration; evaluation plays its tasks in chunks of that size."""
        if self._envs is None:
            self._envs = make_env_batch(self.env_factory, self.args.tasks_per_device * self.num_generations,
                                        self._env_workers, step_timeout=self.args.env_step_timeout,
                                        reset_timeout=self.args.env_reset_timeout)
        return self._envs

    def close_environments(self) -> None:
        """Shut the environment workers down (they also stop when the process exits)."""
        if self._envs is not None:
            self._envs.close()
            self._envs = None

    def _encode_prompt(self, text: str) -> list[int]:
        return encode_prompt(self._tokenizer, text, self.chat_template_kwargs)

    def _lockstep(self) -> bool:
        """Whether every process must run the same number of generate calls (collective backends)."""
        return self.accelerator.num_processes > 1

    def _generation_count(self, count: int) -> int:
        """How many prompts this process sends to one generate call, for `count` of its own."""
        if not self._lockstep():
            return count
        if self.use_vllm and self.vllm_mode == "server":
            counts = self.accelerator.gather(torch.tensor([count], device=self.accelerator.device))
            return max(int(counts.max().item()), 1)
        return max(count, 1)

    def _any_live(self, live: int) -> bool:
        if not self._lockstep():
            return live > 0
        total = self.accelerator.reduce(torch.tensor(live, device=self.accelerator.device), reduction="sum")
        return int(total.item()) > 0

    @contextmanager
    def _generation_backend(self, temperature: float):
        """Yields `generate(prompt_ids) -> (completion_ids, logprobs)` for one whole rollout: weights are synced
        (vLLM) or gathered (ZeRO-3) once per rollout, not once per turn."""
        if self.use_vllm:
            backend = self.vllm_generation
            if self.state.global_step != self._last_loaded_step:
                backend.sync_weights()
                self._last_loaded_step = self.state.global_step
            previous = backend.temperature
            backend.temperature = temperature

            def generate(prompt_ids):
                _, completion_ids, logprobs, _ = backend.generate(prompts=prompt_ids, images=None, num_generations=1)
                return completion_ids, [[lp[0] for lp in seq] for seq in logprobs]

            try:
                yield generate
            finally:
                backend.temperature = previous
            return
        config = copy.deepcopy(self.generation_config)
        config.do_sample = temperature > 0
        if not config.do_sample:  # greedy: sampling settings (TRL's top_k 0 among them) would only draw warnings
            config.temperature, config.top_k = 1.0, None
        else:
            config.temperature = temperature
        with (unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                          gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                          generation_kwargs=self.generation_kwargs,
                                          gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs)
              as model, torch.no_grad()):
            yield partial(self._hf_generate, model, config)

    def _hf_generate(self, model, config: GenerationConfig, prompt_ids: list[list[int]]):
        return generate_completions(model, config, prompt_ids, self._tokenizer.pad_token_id, self.eos_token_ids), None

    def _play(self, tasks: list[Mapping[str, Any]], group_size: int, temperature: float,
              description: str = "rollout") -> Rollout:
        envs = self._environments()
        bar = tqdm(total=self.args.max_env_steps, desc=description, unit="turn", leave=False, dynamic_ncols=True,
                   disable=self.args.disable_tqdm or not self.accelerator.is_main_process)

        def on_turn(turn: int, live: int) -> None:
            bar.update(turn + 1 - bar.n)
            bar.set_postfix(live_episodes=live, refresh=False)

        # Fitting a prompt to the context counts its tokens: keep those ids for generation, not a second encode.
        encoded: dict[str, list[int]] = {}

        def count_tokens(text: str) -> int:
            encoded[text] = self._encode_prompt(text)
            return len(encoded[text])

        with self._generation_backend(temperature) as generate, bar:

            def policy(prompts: list[str]) -> list[Completion]:
                prompt_ids = [encoded[p] if p in encoded else self._encode_prompt(p) for p in prompts]
                encoded.clear()  # the fitting attempts of this turn
                # Keep collective backends in step: pad with a dummy prompt (a process with nothing live still
                # generates; vLLM's server mode needs the same count on every process).
                padded = prompt_ids + [self._encode_prompt("")] * (self._generation_count(len(prompt_ids))
                                                                  - len(prompt_ids))
                if padded:
                    completion_ids, logprobs = generate(padded)
                if not prompt_ids:  # (batch_decode([]) is not [])
                    return []
                completion_ids = completion_ids[: len(prompt_ids)]
                texts = self._tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
                return [Completion(text=text, prompt_ids=p, completion_ids=c,
                                   logprobs=None if logprobs is None else logprobs[i])
                        for i, (text, p, c) in enumerate(zip(texts, prompt_ids, completion_ids, strict=True))]

            return run_rollout(envs, tasks, group_size, policy, self.rollout_settings,
                               keep_going=self._any_live, on_turn=on_turn, count_tokens=count_tokens)

    # ------------------------------------------------------------------ training batch
    def training_step(self, model, inputs, num_items_in_batch):
        tick = time.perf_counter()
        self._batch_seconds = 0.0
        loss = super().training_step(model, inputs, num_items_in_batch)
        # The parent builds the batch (rollout and all) inside training_step: that time is not training.
        self._training_seconds += time.perf_counter() - tick - self._batch_seconds
        # Before the optimizer step: the parameters are still good and no checkpoint holds a NaN. Every process
        # takes the same decision, so none is left waiting in a collective.
        bad = torch.tensor(float(not torch.isfinite(loss).all()), device=self.accelerator.device)
        if self.accelerator.reduce(bad, reduction="max").item() > 0:
            raise FloatingPointError(
                f"non-finite loss at iteration {self._iteration} (1-based; optimizer step {self.state.global_step + 1}): the "
                f"parameters were not updated and the last checkpoint in {self.args.output_dir} is intact; check "
                "the advantages (adv/*) and lower learning_rate, then resume with --resume_from_checkpoint")
        return loss

    def _sample_budget(self) -> int:
        return self.args.per_device_train_batch_size * self.args.steps_per_generation

    def _select(self, num_steps: int) -> np.ndarray:
        """Indices of the steps that become samples: M of them, drawn uniformly when there are more."""
        budget = self._sample_budget()
        if num_steps <= budget:
            return np.arange(num_steps)
        return np.sort(self._sample_rng.choice(num_steps, size=budget, replace=False))

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        start = time.perf_counter()
        mode = "train" if self.model.training else "eval"
        rollout = self._play(list(inputs), self.num_generations, self.temperature)
        self._check_faults(rollout)
        batch = rollout.step_batch()
        tick = time.perf_counter()
        advantages = compute_advantages(self.args.estimator, batch, **self.args.estimator_options())
        if not np.all(np.isfinite(advantages)):
            raise FloatingPointError(f"non-finite advantages at iteration {self._iteration + 1}")
        advantage_seconds = time.perf_counter() - tick
        selected = self._select(len(rollout.steps))
        every = self.args.trajectory_dump_every
        if every and mode == "train" and self._iteration % every == 0:
            self._dump(f"iter_{self._iteration + 1:06d}", self._records(rollout, list(inputs), advantages))
        output = self._training_inputs(rollout, advantages, selected)
        self._log_iteration(mode, rollout, batch, advantages, selected, advantage_seconds)
        self._iteration += 1
        self._batch_seconds = time.perf_counter() - start
        return output

    def _records(self, rollout: Rollout, tasks: list, advantages: np.ndarray | None) -> list[dict]:
        return rollout_records(rollout, tasks, advantages, gamma=self.args.gamma,
                               invalid_penalty=self.args.invalid_penalty, depth=self.args.depth)

    def _dump(self, name: str, records: list[dict]) -> None:
        """Write step records to output_dir/trajectories/<name>[_rank<i>].jsonl (read by hgpo_trl.trajectories)."""
        suffix = f"_rank{self.accelerator.process_index}" if self.accelerator.num_processes > 1 else ""
        write_records(Path(self.args.output_dir) / "trajectories" / f"{name}{suffix}.jsonl", records)

    def _check_faults(self, rollout: Rollout) -> None:
        """A broken environment must stop the run, not let it train on nothing for days: after
        `max_faulty_iterations` mostly-faulted iterations in a row, save a checkpoint and raise."""
        faulted = sum(e.fault is not None for e in rollout.episodes)
        local = torch.tensor(float(2 * faulted > len(rollout.episodes)), device=self.accelerator.device)
        mostly_faulted = self.accelerator.reduce(local, reduction="max").item() > 0  # the same on every process
        self._faulty_streak = self._faulty_streak + 1 if mostly_faulted else 0
        limit = self.args.max_faulty_iterations
        if limit and self._faulty_streak >= limit:
            self._save_checkpoint(self.model, trial=None)
            example = next((e.fault for e in rollout.episodes if e.fault is not None), "on another process")
            raise RuntimeError(
                f"environment faults: more than half the episodes failed in {limit} iterations in a row "
                f"(iteration {self._iteration}; e.g. {example}). A checkpoint was saved in {self.args.output_dir}; "
                "fix the environment (or raise env_step_timeout / max_faulty_iterations) and resume with "
                "--resume_from_checkpoint")

    def _training_inputs(self, rollout: Rollout, advantages: np.ndarray, selected: np.ndarray) -> dict[str, Any]:
        device = self.accelerator.device
        padding = self._sample_budget() - len(selected)
        steps = [rollout.steps[i] for i in selected]
        # Padding rows are masked out of the loss (completion_mask 0, advantage 0): every process keeps the same
        # number of samples, so forward passes stay in step (ZeRO-3) and TRL's batch split drops nothing.
        prompts = [torch.tensor(s.completion.prompt_ids) for s in steps] + [torch.tensor([self._tokenizer.pad_token_id])] * padding
        completions = [torch.tensor(s.completion.completion_ids) for s in steps] + [torch.tensor([self.eos_token_ids[0]])] * padding
        real = [1] * len(steps) + [0] * padding
        prompt_ids = pad(prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device)
        completion_ids = pad(completions, padding_value=self._tokenizer.pad_token_id, padding_side="right").to(device)
        completion_mask = pad([torch.full_like(c, r) for c, r in zip(completions, real, strict=True)],
                              padding_value=0, padding_side="right").to(device)
        if self.mask_truncated_completions:
            truncated = torch.tensor([c[-1].item() not in self.eos_token_ids for c in completions], device=device)
            completion_mask = completion_mask * (~truncated).unsqueeze(1).int()
        advantage = torch.tensor(np.r_[advantages[selected], np.zeros(padding)], dtype=torch.float32, device=device)
        output = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                  "completion_mask": completion_mask, "advantages": advantage,
                  "num_items_in_batch": self.accelerator.gather(completion_mask.sum()).sum()}
        output.update(self._logprob_inputs(steps, padding, prompt_ids, prompt_mask, completion_ids, completion_mask))
        return output

    def _logprob_inputs(self, steps, padding, prompt_ids, prompt_mask, completion_ids, completion_mask) -> dict:
        """old / reference / sampling log-probabilities, computed when the loss needs them (as the parent does)."""
        out: dict[str, torch.Tensor] = {}
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        width = completion_ids.size(1)
        batch_size = self.args.per_device_train_batch_size
        is_correction = self.use_vllm and self.vllm_importance_sampling_correction
        with torch.no_grad():
            if self.args.gradient_accumulation_steps % (self.args.steps_per_generation * self.num_iterations) or is_correction:
                out["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, width, batch_size=batch_size)
            if self.beta != 0.0:
                if self.ref_model is not None:
                    out["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        self.ref_model, input_ids, attention_mask, width, batch_size=batch_size)
                else:  # PEFT: the model with its adapter disabled is the reference
                    with self.accelerator.unwrap_model(self.model).disable_adapter():
                        out["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                            self.model, input_ids, attention_mask, width, batch_size=batch_size)
        if is_correction:
            sampled = [torch.tensor([float("nan") if x is None else x for x in s.completion.logprobs]) for s in steps]
            sampled += [torch.zeros(1)] * padding
            sampling = pad(sampled, padding_value=0.0, padding_side="right").to(input_ids.device)
            out["sampling_per_token_logps"] = sampling
            out["importance_sampling_ratio"] = self._importance_ratio(out["old_per_token_logps"], sampling,
                                                                      completion_mask)
        return out

    def _importance_ratio(self, old, sampling, mask) -> torch.Tensor:
        """vLLM/trainer mismatch correction, with the parent's modes (token/sequence x truncate/mask)."""
        diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
        mode = self.vllm_importance_sampling_mode
        if mode.startswith("sequence"):
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        low = self.vllm_importance_sampling_clip_min
        high = self.vllm_importance_sampling_clip_max
        if mode.endswith("truncate"):
            return torch.clamp(ratio, min=low, max=high)
        outside = (ratio < (-float("inf") if low is None else low)) | (ratio > (float("inf") if high is None else high))
        return ratio.masked_fill(outside, 0.0)

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial) -> None:
        """The parent's checkpoint, written under `output_dir/.staging` and renamed into place once complete: a
        run killed mid-save leaves the previous checkpoint as the latest, never a half-written one."""
        run_dir = self._get_output_dir(trial=trial)
        staging = os.path.join(run_dir, STAGING_DIR)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
        self.accelerator.wait_for_everyone()
        self._get_output_dir = lambda trial=None: staging  # the parent writes and rotates there
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            final = os.path.join(run_dir, name)
            shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step (a resumed run)
            os.replace(os.path.join(staging, name), final)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------ logging
    def _log_iteration(self, mode: str, rollout: Rollout, batch, advantages: np.ndarray, selected: np.ndarray,
                       advantage_seconds: float) -> None:
        episodes = rollout.episodes
        steps = rollout.steps
        local = {
            "env/success_rate": np.mean([e.won for e in episodes]),
            "env/episode_reward": np.mean([e.total_reward for e in episodes]),
            "env/episode_length": np.mean([e.steps for e in episodes]),
            "env/invalid_rate": np.mean([not s.valid for s in steps]) if steps else 0.0,
            "env/faults": sum(e.fault is not None for e in episodes),
            "adv/mean": float(np.mean(advantages)) if steps else 0.0,
            "adv/std": float(np.std(advantages)) if steps else 0.0,
            "steps/collected": len(steps),
            "steps/kept": len(selected),
            "steps/kept_fraction": len(selected) / max(len(steps), 1),
            "steps/padded_fraction": 1.0 - len(selected) / self._sample_budget(),
            "time/generation": rollout.generation_seconds,
            "time/env": rollout.env_seconds,
            "time/rollout": rollout.seconds,
            "time/advantages": advantage_seconds,
            "time/training": self._training_seconds,
            "throughput/env_steps_per_second": len(steps) / max(rollout.seconds, 1e-9),
            **rollout.prompt_stats(),
        }
        scores = [e.score for e in episodes if e.score is not None]
        if scores:  # environments that grade outcomes (WebShop's purchase score)
            local["env/score"] = float(np.mean(scores))
        every = self.args.diagnostics_every
        if every and mode == "train" and self._iteration % every == 0:
            # Every process logs the same keys (metrics are gathered), even one left with no step.
            estimators = self.args.diagnostic_estimators()
            report = advantage_bias(batch, estimators, gamma=self.args.gamma, norm=self.args.advantage_norm,
                                    invalid_penalty=self.args.invalid_penalty) if steps else {}
            for label in estimators:
                bias = report.get(label, Bias(0.0, 0.0, 0.0, 0))
                local[f"diag/{label}_bias"], local[f"diag/{label}_spread"] = bias.bias, bias.spread
                local["diag/oracle_steps"] = bias.steps
        if self.args.estimator == "hgpo" and steps:
            self.last_level_stats = hgpo_level_stats(batch, history_length=self.args.depth)
            for level in self.last_level_stats:
                local[f"hgpo/level{level.level}_with_peers"] = level.with_peers / len(steps)
        self._training_seconds = 0.0
        names = sorted(local)
        gathered = self.accelerator.gather(torch.tensor([float(local[k]) for k in names],
                                                        device=self.accelerator.device)[None])
        for name, column in zip(names, gathered.reshape(-1, len(names)).T.tolist(), strict=True):
            self._metrics[mode][name].append(float(np.mean(column)))
        kept = [steps[i] for i in selected]
        self._logs["prompt"].extend(gather_object([s.prompt for s in kept]))
        self._logs["completion"].extend(gather_object([s.completion.text for s in kept]))
        self._logs["rewards"]["env_reward"].extend(gather_object([s.reward for s in kept]))
        self._logs["advantages"].extend(gather_object(advantages[selected].tolist()))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Play every validation task once at `eval_temperature` and log the success rate (the parent's
        evaluation would play G x G rollouts per task)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset of task rows")
        rows = list(dataset)
        if self.args.eval_max_tasks is not None:
            rows = rows[: self.args.eval_max_tasks]
        processes = self.accelerator.num_processes
        chunk = len(self._environments())
        # Every process plays as many chunks as the busiest one, even with no task of its own left: generation
        # may be collective.
        chunks = max(1, math.ceil(math.ceil(len(rows) / processes) / chunk))
        rows = rows[self.accelerator.process_index:: processes]
        was_training = self.model.training
        self.model.eval()
        try:
            episodes, records = [], []
            for c in range(chunks):
                tasks = rows[c * chunk:(c + 1) * chunk]
                rollout = self._play(tasks, 1, self.args.eval_temperature, f"evaluation {c + 1}/{chunks}")
                episodes += rollout.episodes
                if self.args.trajectory_dump_every:
                    for record in self._records(rollout, tasks, None):
                        # Episode numbers run on across chunks, so a reader keeps the episodes apart.
                        record["episode"] += c * chunk
                        records.append(record)
            if self.args.trajectory_dump_every:
                self._dump(f"eval_step_{self.state.global_step:06d}", records)
            local = torch.tensor([sum(e.won for e in episodes), sum(e.total_reward for e in episodes),
                                  sum(e.steps for e in episodes), len(episodes),
                                  sum(e.score or 0.0 for e in episodes), sum(e.score is not None for e in episodes)],
                                 dtype=torch.float64, device=self.accelerator.device)
            won, reward, length, count, score, scored = self.accelerator.reduce(local, reduction="sum").tolist()
            count = max(count, 1.0)
            metrics = {f"{metric_key_prefix}_success_rate": won / count,
                       f"{metric_key_prefix}_episode_reward": reward / count,
                       f"{metric_key_prefix}_episode_length": length / count,
                       f"{metric_key_prefix}_tasks": count}
            if scored:
                metrics[f"{metric_key_prefix}_score"] = score / scored
            self.log(metrics)  # in eval mode: training metrics stay for the next training log
        finally:
            self.model.train(was_training)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

