"""`HGPOTrainer`: TRL's `GRPOTrainer` trained on per-step samples of multi-turn environment rollouts.

One iteration: each process plays its `tasks_per_device` tasks `num_generations` times (`hgpo_trl.rollout`),
every step becomes one (prompt, completion) sample with its own advantage (`hgpo_trl.advantages`), and the
parent's machinery (clipped loss, KL, optimizer, logging) trains on them, in one of two ways
(`HGPOConfig.step_batching`, `hgpo_trl.step_batches`): a fixed budget of samples through TRL's own buffer, or
every step once in as many optimizer steps as the steps fill (as released). Only what per-step samples require
is overridden: the task dataloader, the batch (`_generate_and_score_completions`, `_prepare_inputs`), the
schedule, checkpoints and `evaluate`.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import transformers
import trl
from accelerate import PartialState
from accelerate.utils import gather_object
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel
from transformers.integrations import TensorBoardCallback
from transformers.integrations.integration_utils import default_logdir
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation
from trl.trainer.utils import pad, use_adapter

import hgpo_trl
from hgpo_trl.advantages import StepBatch, compute_advantages, hgpo_level_stats
from hgpo_trl.checkpoints import cpu_map_location, read_trainer_state, save_staged, write_trainer_state
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import TextEnv, make_env
from hgpo_trl.envs.pool import EnvBatch, default_num_workers, make_env_batch
from hgpo_trl.envs.registry import is_fast_env
from hgpo_trl.generation import (
    encode_prompt,
    generate_completions,
    generation_settings,
    prompts_per_call,
    slices_by_position,
)
from hgpo_trl.iterations import EarlyStop, IterationCadence, IterationCount, iteration_schedule
from hgpo_trl.metrics import SampleCounts, combine_processes, iteration_metrics
from hgpo_trl.model_card import render_model_card
from hgpo_trl.reporting import quiet_console, transformers_bars_off
from hgpo_trl.rollout import Completion, Rollout, StepRecord, run_rollout
from hgpo_trl.sampler import TaskSampler
from hgpo_trl.step_batches import (
    importance_sampling_ratio,
    plan_micro_batches,
    sample_tensors,
    sampling_metrics,
    select_budget,
    windows_for,
)
from hgpo_trl.trajectories import rollout_records, write_records

# The keys of the generation dict that GRPOTrainer's loss reads (tests/test_trainer.py pins them).
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
        # Where training started, for the model card (before the in-memory reference renames it).
        self._base_model = model if isinstance(model, str) else str(getattr(model.config, "_name_or_path", "") or "")
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
        self.rollout_settings = generation_settings(args.rollout_settings(), self._tokenizer, self.model.config,
                                                    args.vllm_max_model_length if args.use_vllm else None,
                                                    args.max_completion_length)
        self._env_workers = args.env_workers
        if self._env_workers is None:  # a slow environment gets a worker pool sized to this process's cores
            fast = env_factory is not None or is_fast_env(args.env_name)
            self._env_workers = 0 if fast else default_num_workers(self.accelerator.state.num_processes)
        self._envs: EnvBatch | None = None
        self.last_level_stats: list = []  # HGPO's level statistics of the last rollout (plots)
        self._sample_rng = np.random.default_rng(args.seed + self.accelerator.process_index)
        self._training_seconds = 0.0
        self._batch_seconds = 0.0
        # Rollouts started (the 1-based number of the current iteration), in a mutable object: the Trainer builds a
        # DeepSpeed-config scheduler on a shallow copy of itself, and the iteration schedule must see the count.
        self._iterations = IterationCount()
        self._faulty_streak = 0
        self._micro_batches: deque[dict[str, Any]] = deque()  # all_steps: the current iteration's, in order
        self._task_sampler = self._get_train_sampler()  # all_steps: an iteration's tasks from its number
        if args.eval_every_iterations and eval_dataset is None:
            raise ValueError("HGPOConfig.eval_every_iterations needs an eval_dataset of task rows")
        if args.early_stop_success is not None and eval_dataset is None:
            raise ValueError("HGPOConfig.early_stop_success needs an eval_dataset of task rows (it stops on "
                             "validation success)")
        if args.step_batching == "all_steps" and self.is_deepspeed_enabled and \
                self.accelerator.state.deepspeed_plugin.deepspeed_config.get("scheduler"):
            raise ValueError("step_batching='all_steps' schedules the learning rate by iteration: remove the "
                             "'scheduler' section of the DeepSpeed config (it would step per optimizer step over "
                             "max_steps, only an upper bound) and set lr_scheduler_type instead")
        self.add_callback(IterationCadence(self))
        self.early_stop = EarlyStop(self)
        self.add_callback(self.early_stop)
        quiet_console(self)

    # ------------------------------------------------------------------ tasks
    def get_train_dataloader(self):
        if self.args.step_batching == "all_steps":
            # The batches come from the rollouts (_prepare_inputs): the dataloader only counts the micro-steps,
            # max_steps windows of gradient_accumulation_steps on every process.
            ticks = Dataset.from_dict({"tick": list(range(self.args.max_steps * self.args.gradient_accumulation_steps
                                                         * self.accelerator.num_processes))})
            return self._get_dataloader(dataset=ticks, description="Training", batch_size=1,
                                        sampler_fn=lambda dataset: torch.utils.data.SequentialSampler(dataset),
                                        is_training=True)
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
        counts = None
        if slices_by_position(self.use_vllm, self.vllm_mode, self.vllm_tensor_parallel_size):
            counts = self.accelerator.gather(torch.tensor([count], device=self.accelerator.device)).tolist()
        return prompts_per_call(count, counts)

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
              as model, torch.no_grad(),
              # FSDP (v1) shards the parameters: gather them for generation, as TRL does (a no-op otherwise).
              self._dist.summon_full_params(self.model_wrapped, recurse=False)):
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

    # ------------------------------------------------------------------ iterations
    @property
    def _iteration(self) -> int:
        return self._iterations.started

    @_iteration.setter
    def _iteration(self, value: int) -> None:
        self._iterations.started = value

    @property
    def at_iteration_boundary(self) -> bool:
        """Whether the last optimizer step ended an iteration (checkpoints and evaluations go there only)."""
        if self.args.step_batching == "all_steps":
            return not self._micro_batches
        return self._step % (self.args.steps_per_generation * self.num_iterations) == 0

    @property
    def completed_iterations(self) -> int:
        return self._iteration - (0 if self.at_iteration_boundary else 1)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Under all_steps the schedule runs over `train_iterations` and is read at the completed iterations:
        max_steps is only a bound, and the optimizer steps of one iteration share its learning rate."""
        if self.args.step_batching != "all_steps" or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        schedule = super().create_scheduler(self.args.train_iterations, optimizer)
        self.lr_scheduler = iteration_schedule(schedule, lambda: self.completed_iterations)
        return self.lr_scheduler

    def _play_iteration(self, tasks: list[Mapping[str, Any]]) -> tuple[Rollout, StepBatch, np.ndarray, float]:
        """One training rollout of `tasks` and its advantages (on all steps): (rollout, batch, advantages,
        seconds spent on the advantages). Stops every process when the environments keep failing or an
        advantage is not finite."""
        rollout = self._play(tasks, self.num_generations, self.temperature)
        self._check_faults(rollout)
        batch = rollout.step_batch()
        tick = time.perf_counter()
        advantages = compute_advantages(self.args.estimator, batch, **self.args.estimator_options())
        advantage_seconds = time.perf_counter() - tick
        bad = torch.tensor(float(not np.all(np.isfinite(advantages))), device=self.accelerator.device)
        if self.accelerator.reduce(bad, reduction="max").item() > 0:  # decided together: no process waits alone
            raise FloatingPointError(f"non-finite advantages at iteration {self._iteration + 1} (estimator "
                                     f"{self.args.estimator!r}); the parameters were not updated")
        every = self.args.trajectory_dump_every
        if every and self._iteration % every == 0:
            self._dump(f"iter_{self._iteration + 1:06d}", self._records(rollout, tasks, advantages))
        return rollout, batch, advantages, advantage_seconds

    # ------------------------------------------------------------------ fixed_budget: through TRL's buffer
    def training_step(self, model, inputs, num_items_in_batch):
        tick = time.perf_counter()
        self._batch_seconds = 0.0
        if self.args.step_batching == "all_steps" and not self._micro_batches:
            self._micro_batches.extend(self._all_steps_iteration())
            self._batch_seconds = time.perf_counter() - tick
            if not self._micro_batches:
                # The last iterations collected no step on any process: no backward, so the gradients stay None
                # and the optimizer step the Trainer still takes moves nothing; IterationCadence stops the run.
                return torch.zeros((), device=self.accelerator.device)
        loss = super().training_step(model, inputs, num_items_in_batch)
        # The parent builds the batch (rollout and all) inside training_step: that time is not training.
        self._training_seconds += time.perf_counter() - tick - self._batch_seconds
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, checked before its backward: under DeepSpeed the optimizer steps inside the backward of a
        window's last micro-batch, so a check after it would come too late. Every process takes the same
        decision, so none is left waiting in a collective."""
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        bad = torch.tensor(float(not torch.isfinite(loss).all()), device=self.accelerator.device)
        if self.model.training and self.accelerator.reduce(bad, reduction="max").item() > 0:
            raise FloatingPointError(
                f"non-finite loss at iteration {self._iteration} (1-based; optimizer step {self.state.global_step + 1}): the "
                f"parameters were not updated and the last checkpoint in {self.args.output_dir} is intact; check "
                "the advantages (adv/*) and lower learning_rate, then resume with --resume_from_checkpoint")
        return loss

    def _sample_budget(self) -> int:
        return self.args.per_device_train_batch_size * self.args.steps_per_generation

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        start = time.perf_counter()
        mode = "train" if self.model.training else "eval"
        rollout, batch, advantages, advantage_seconds = self._play_iteration(list(inputs))
        selected = select_budget(len(rollout.steps), self._sample_budget(), self._sample_rng)
        padding = self._sample_budget() - len(selected)
        # Padding rows are masked out of the loss (completion_mask 0, advantage 0): every process keeps the same
        # number of samples, so forward passes stay in step (ZeRO-3) and TRL's batch split drops nothing.
        output = self._samples([rollout.steps[i] for i in selected], advantages[selected], padding)
        output["num_items_in_batch"] = self.accelerator.gather(output["completion_mask"].sum()).sum()
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            aligned = self.args.gradient_accumulation_steps % (self.args.steps_per_generation * self.num_iterations) == 0
            output.update(self._logprob_inputs(output, [rollout.steps[i] for i in selected], old=not aligned))
        samples = SampleCounts(kept=len(selected), padded_fraction=padding / self._sample_budget(),
                               optimizer_steps=self.args.steps_per_generation * self.num_iterations
                               // self.args.gradient_accumulation_steps)
        self._log_iteration(mode, rollout, batch, advantages, samples, advantage_seconds)
        self._log_samples([rollout.steps[i] for i in selected], advantages[selected])
        self._iteration += 1
        self._batch_seconds = time.perf_counter() - start
        return output

    # ------------------------------------------------------------------ all_steps: every step, as released
    def _prepare_inputs(self, inputs):
        """all_steps: the next micro-batch of the current iteration (training_step plays the next iteration when
        they are used up; the parent's buffer would regenerate every steps_per_generation x num_iterations
        micro-steps)."""
        if self.args.step_batching != "all_steps" or not self.model.training:
            return super()._prepare_inputs(inputs)
        return self._micro_batches.popleft()

    def _all_steps_iteration(self) -> list[dict[str, Any]]:
        """The micro-batches of the next iteration that collects a step on some process: every step once, the
        last micro-batch short or filled with copies (`fill_last_micro_batch`), then micro-batches of padding
        alone so that every process runs the busiest one's count of windows, repeated
        `num_iterations` times. Log-probabilities are taken here, before the first update. Empty when the
        remaining iterations collect no step at all."""
        rank, processes = self.accelerator.process_index, self.accelerator.num_processes
        micro, accumulation = self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps
        windows = 0
        while not windows:  # no optimizer step on nothing: an iteration whose episodes all failed trains none
            if self._iteration >= self.args.train_iterations:
                return []
            tasks = [self.train_dataset[i] for i in self._task_sampler.iteration_tasks(self._iteration, rank, processes)]
            rollout, batch, advantages, advantage_seconds = self._play_iteration(tasks)
            plan = plan_micro_batches(len(rollout.steps), micro, self.args.fill_last_micro_batch,
                                      self.args.shuffle_steps, self._sample_rng)
            busiest = self.accelerator.reduce(torch.tensor(len(plan), device=self.accelerator.device), reduction="max")
            windows = windows_for(int(busiest.item()), accumulation)
            trained = sum(len(rows) for rows in plan)
            samples = SampleCounts(kept=len(rollout.steps), duplicated=trained - len(rollout.steps),
                                   padded_fraction=1.0 - trained / max(windows * accumulation * micro, 1),
                                   optimizer_steps=windows * self.num_iterations)
            self._log_iteration("train", rollout, batch, advantages, samples, advantage_seconds)
            self._iteration += 1
        plan += [np.zeros(0, dtype=np.int64)] * (windows * accumulation - len(plan))
        steps = [[rollout.steps[i] for i in rows] for rows in plan]
        self._log_samples([s for chunk in steps for s in chunk], np.concatenate([advantages[rows] for rows in plan]))
        # Every micro-batch holds `micro` rows on every process (TRL gathers per-row loss metrics): a short one is
        # filled with masked rows, and one of padding alone is 2 tokens wide.
        micro_batches = [self._samples(chunk, advantages[rows], padding=micro - len(rows))
                         for chunk, rows in zip(steps, plan, strict=True)]
        # dapo divides by num_items_in_batch / processes x accumulation / steps_per_generation: make that the
        # mini-batch's mean token count per process, so the summed micro-batch losses are its token mean.
        tokens = torch.stack([sum(m["completion_mask"].sum() for m in micro_batches[w * accumulation:(w + 1) * accumulation])
                              for w in range(windows)]).float()
        tokens = self.accelerator.reduce(tokens, reduction="sum") * self.args.steps_per_generation / accumulation
        old = windows * self.num_iterations > 1 or (self.use_vllm and self.vllm_importance_sampling_correction)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for k, (micro_batch, chunk) in enumerate(zip(micro_batches, steps, strict=True)):
                micro_batch["num_items_in_batch"] = tokens[k // accumulation]
                micro_batch.update(self._logprob_inputs(micro_batch, chunk, old=old))
        return micro_batches * self.num_iterations

    # ------------------------------------------------------------------ samples
    def _samples(self, steps: list[StepRecord], advantages: np.ndarray, padding: int) -> dict[str, torch.Tensor]:
        return sample_tensors(steps, advantages, padding, self._tokenizer.pad_token_id, self.eos_token_ids[0],
                              self.accelerator.device, self.mask_truncated_completions, self.eos_token_ids)

    def _logprob_inputs(self, samples: dict[str, torch.Tensor], steps: list[StepRecord], old: bool) -> dict:
        """old / reference / sampling log-probabilities of `samples` (whose real rows are `steps`), computed
        when the loss needs them, as the parent does. Runs under no_grad with gradient checkpointing off."""
        out: dict[str, torch.Tensor] = {}
        input_ids = torch.cat([samples["prompt_ids"], samples["completion_ids"]], dim=1)
        attention_mask = torch.cat([samples["prompt_mask"], samples["completion_mask"]], dim=1)
        width = samples["completion_ids"].size(1)
        batch_size = self.args.per_device_train_batch_size
        is_correction = self.use_vllm and self.vllm_importance_sampling_correction
        if old or is_correction:
            out["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, width, batch_size=batch_size)
        if self.beta != 0.0:
            if self.ref_model is not None:
                out["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.ref_model, input_ids, attention_mask, width, batch_size=batch_size)
            else:  # PEFT, as TRL: a new adapter's reference is the base model (adapter disabled); a model passed
                # in with its adapter already trained has TRL's frozen copy of it, the "ref" adapter
                model = self.accelerator.unwrap_model(self.model)
                with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                    out["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        self.model, input_ids, attention_mask, width, batch_size=batch_size)
        if self.use_vllm and steps and all(s.completion.logprobs is not None for s in steps):
            # Passed whenever the backend gave them, as TRL does (its off-policy mask reads them).
            sampled = [torch.tensor([float("nan") if x is None else x for x in s.completion.logprobs]) for s in steps]
            sampled += [torch.zeros(1)] * (input_ids.size(0) - len(steps))
            out["sampling_per_token_logps"] = pad(sampled, padding_value=0.0, padding_side="right").to(input_ids.device)
        if is_correction:
            sampling = out.get("sampling_per_token_logps", out["old_per_token_logps"])  # (padding alone: no vLLM rows)
            out["importance_sampling_ratio"] = importance_sampling_ratio(
                out["old_per_token_logps"], sampling, samples["completion_mask"], self.vllm_importance_sampling_mode,
                self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max)
            out["sampling_per_token_logps"] = sampling
            self._log_gathered("train", sampling_metrics(out["old_per_token_logps"], sampling,
                                                         out["importance_sampling_ratio"], samples["completion_mask"]))
        return out

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

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The parent's, without transformers' "Writing model shards" bar (one per save, between our lines); a
        user's save (not a checkpoint's) also refreshes the model card with the evaluations so far."""
        with transformers_bars_off():
            super().save_model(output_dir, _internal_call)
        if not _internal_call and (output_dir is None or Path(output_dir) == Path(self.args.output_dir)):
            self.create_model_card()

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None) -> None:
        """Our own README.md (TRL's describes GRPO and a base model of "None" for one built in memory)."""
        if not self.is_world_process_zero():
            return
        card = render_model_card(
            model_name=model_name or Path(self.args.output_dir).name, base_model=self._base_model, args=self.args,
            estimator_options=self.args.estimator_options(), log_history=self.state.log_history,
            completed_iterations=self.completed_iterations,
            versions={"hgpo-trl": hgpo_trl.__version__, "TRL": trl.__version__,
                      "Transformers": transformers.__version__, "PyTorch": torch.__version__})
        Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
        Path(self.args.output_dir, "README.md").write_text(card)

    def _save_checkpoint(self, model, trial) -> None:
        """The parent's checkpoint plus the iterations played, written in a staging folder and renamed into
        place (`hgpo_trl.checkpoints`)."""
        parent = super()._save_checkpoint

        def write(folder: str) -> None:
            parent(model, trial)
            # Every process its own: the sub-sampling stream is seeded per process.
            write_trainer_state(folder, self.accelerator.process_index, {
                "iterations": self.completed_iterations, "faulty_streak": self._faulty_streak,
                "sample_rng": self._sample_rng.bit_generator.state})

        save_staged(self, trial, write)

    def _determine_best_metric(self, metrics, trial) -> bool:
        """The Trainer marks the best step only under step or epoch save strategies: also under
        save_every_iterations, so load_best_model_at_end and rotation know the best checkpoint."""
        is_new_best = super()._determine_best_metric(metrics, trial)
        if is_new_best and self.args.save_every_iterations:
            self.state.best_global_step = self.state.global_step
        return is_new_best

    def _load_optimizer_and_scheduler(self, checkpoint):
        with cpu_map_location(self.args.device):
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        # A resumed run continues the iteration count (the stop, the tasks, the schedule, dump names and the
        # diagnostics cadence), the fault streak and the sub-sampling stream: it is the run it continues.
        state = read_trainer_state(checkpoint, self.accelerator.process_index)
        self._iteration = state.get("iterations", self._iteration)
        self._faulty_streak = state.get("faulty_streak", self._faulty_streak)
        if "sample_rng" in state:
            self._sample_rng.bit_generator.state = state["sample_rng"]

    # ------------------------------------------------------------------ logging
    def _log_iteration(self, mode: str, rollout: Rollout, batch: StepBatch, advantages: np.ndarray,
                       samples: SampleCounts, advantage_seconds: float) -> None:
        every = self.args.diagnostics_every
        levels = None
        if self.args.estimator == "hgpo":
            levels = hgpo_level_stats(batch, depth=self.args.depth)
            self.last_level_stats = levels if rollout.steps else self.last_level_stats
        local = iteration_metrics(rollout, batch, advantages, samples, self.args, levels,
                                  eos_token_ids=self.eos_token_ids,
                                  diagnostics=bool(every) and mode == "train" and self._iteration % every == 0,
                                  advantage_seconds=advantage_seconds, training_seconds=self._training_seconds)
        self._training_seconds = 0.0
        self._log_gathered(mode, local)
        # TRL's num_tokens: the prompt and completion tokens of every step played so far, over all processes.
        tokens = sum(len(s.completion.prompt_ids) + len(s.completion.completion_ids) for s in rollout.steps)
        self.state.num_input_tokens_seen += int(self.accelerator.reduce(
            torch.tensor(tokens, device=self.accelerator.device), reduction="sum").item())
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]

    def _log_gathered(self, mode: str, local: dict[str, float]) -> None:
        """Gather every process's `local` metrics (the same keys everywhere) and log them combined."""
        names = sorted(local)
        gathered = self.accelerator.gather(torch.tensor([local[k] for k in names], device=self.accelerator.device)[None])
        for name, value in combine_processes(names, gathered.reshape(-1, len(names)).cpu().numpy()).items():
            self._metrics[mode][name].append(value)

    def _log_samples(self, steps: list[StepRecord], advantages: np.ndarray) -> None:
        """The completions table (TRL's `log_completions`): the trained samples of the iteration, gathered only
        when it is asked for (an ALFWorld iteration holds thousands of prompts of thousands of tokens)."""
        if not self.args.log_completions:
            return
        self._logs["prompt"].extend(gather_object([s.prompt for s in steps]))
        self._logs["completion"].extend(gather_object([s.completion.text for s in steps]))
        self._logs["rewards"]["env_reward"].extend(gather_object([s.reward for s in steps]))
        self._logs["advantages"].extend(gather_object(advantages.tolist()))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:  # training logs say which iteration they end in
            logs = {**logs, "iteration": self._iteration}
        elif "eval_success_rate" in logs:  # an evaluation, after the iterations completed
            logs = {**logs, "iteration": self.completed_iterations}
        super().log(logs, start_time)

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

