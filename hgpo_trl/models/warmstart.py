"""A supervised warm start on random admissible actions (TRL's `SFTTrainer`), and the text corpus of an
environment for building a tiny tokenizer.

A model trained from scratch emits no valid action, so RL has no signal: 99-100% of a random tiny model's
outputs are invalid. A short SFT on the prompts of random episodes teaches the answer format and nothing about
which action is good, so the RL run still starts near chance. Every prompt is paired with EVERY admissible
action, not one sampled action: with one, a small model memorises an arbitrary choice per prompt and starts RL
confident and wrong, its G rollouts of a task all alike (no exploration, no advantage signal); with all, the
SFT optimum is the uniform policy over admissible actions.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from accelerate.state import AcceleratorState, PartialState
from datasets import Dataset
from tqdm import tqdm
from transformers.trainer import DEFAULT_PROGRESS_CALLBACK
from transformers.trainer_callback import PrinterCallback
from trl import SFTConfig, SFTTrainer
from trl.data_utils import common_prefix_length

from hgpo_trl.config import cpu_precision_default
from hgpo_trl.envs.base import EnvironmentFaults, TextEnv
from hgpo_trl.rollout.actions import FORMAT_INSTRUCTIONS, format_action
from hgpo_trl.rollout.memory import Memory, build_prompt
from hgpo_trl.runtime.progress import progress_bar, shows_bars
from hgpo_trl.training.reporting import BarOnly

FAULT_WINDOW = 8
"""Random play's fault rule is read once this many episodes were played (or when the play ends): one faulted
episode of the first is no broken environment."""


@dataclass
class FaultTally:
    """The episodes a random play played and those an environment fault ended, over one or several calls."""

    description: str
    played: int = 0
    faults: list[str] = field(default_factory=list)

    def check(self, *, final: bool) -> None:
        """Stop (`EnvironmentFaults`) when more than half the episodes faulted, as the trainer's fault streak stops
        a run: from `FAULT_WINDOW` episodes on, or at the end of the play (`final`)."""
        if (final or self.played >= FAULT_WINDOW) and 2 * len(self.faults) > self.played:
            raise EnvironmentFaults(f"{self.description}: the environment failed in {len(self.faults)} of "
                                    f"{self.played} episodes (e.g. {self.faults[0]}); fix the environment (its "
                                    "env_kwargs, its data)")


def random_play(env: TextEnv, tasks: Sequence[Mapping[str, Any]], episodes: int, *, history_length: int,
                max_steps: int, format_instruction: str = "", seed: int | random.Random = 0, progress: bool = False,
                max_pairs: int | None = None, description: str = "random episodes",
                tally: FaultTally | None = None) -> list[tuple[str, list[str], str]]:
    """(prompt, admissible actions, next observation) for every step of `episodes` episodes that take uniformly
    random admissible actions, with the prompts the rollout would build. The tasks come in a random order
    (each once before any repeats). `progress`: a bar of the episodes played (where bars do not
    show, a line every 30 s: `hgpo_trl.runtime.progress`); `max_pairs`: stop after the episode in which the (prompt, admissible action) pairs
    reach this many.

    An environment that raises ends its episode, whose steps are dropped, as a training rollout treats a fault;
    more than half the episodes faulted stops the play (`FaultTally.check`). `tally`: a play of several calls
    counts its faults there, and its caller checks the end."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)  # (a play of several calls: one stream)
    order = rng.sample(range(len(tasks)), len(tasks))
    samples: list[tuple[str, list[str], str]] = []
    pairs = 0
    own = tally is None
    tally = FaultTally(description) if own else tally
    for episode in progress_bar(iterable=range(episodes), desc=description, unit="episode", leave=False,
                                disabled=not progress):
        if max_pairs is not None and pairs >= max_pairs:
            break
        tally.played += 1
        try:
            steps = _random_episode(env, tasks[order[episode % len(tasks)]], rng, history_length=history_length,
                                    max_steps=max_steps, format_instruction=format_instruction)
        except Exception as err:  # (the environment's own failure, whatever its type)
            tally.faults.append(f"{type(err).__name__}: {err}")
            tally.check(final=False)
            continue
        samples += steps
        pairs += sum(len(admissible) for _, admissible, _ in steps)
    if own:
        tally.check(final=True)
    return samples


def _random_episode(env: TextEnv, task: Mapping[str, Any], rng: random.Random, *, history_length: int,
                    max_steps: int, format_instruction: str) -> list[tuple[str, list[str], str]]:
    """One episode of uniformly random admissible actions: (prompt, admissible actions, next observation) a step."""
    observation, info = env.reset(task)
    memory = Memory()
    steps = []
    for step in range(max_steps):
        admissible = info.get("admissible_actions", [])
        if not admissible:
            break
        prompt, _ = build_prompt(env.render_prompt, info.get("task", ""), memory, observation, admissible, step,
                                 history_length, format_instruction)
        action = rng.choice(admissible)
        next_observation, _, terminated, truncated, info = env.step(action)
        steps.append((prompt, list(admissible), next_observation))
        memory.add(observation, action)
        observation = next_observation
        if terminated or truncated:
            break
    return steps


def environment_corpus(env: TextEnv, tasks: Sequence[Mapping[str, Any]], episodes: int = 200,
                       history_length: int = 2, max_steps: int = 8, progress: bool = False) -> list[str]:
    """Texts that cover what the environment's prompts and actions can hold (tiny-tokenizer training data): the
    texts of `episodes` random episodes, or, for an environment that lists its words (`env.vocabulary(tasks)`,
    e.g. ALFWorld, where every new game costs seconds), those and two episodes for the prompt's own words."""
    # The text modes' instructions (a new mode's would change every tiny model's vocabulary, the quickstart's too).
    texts = [FORMAT_INSTRUCTIONS["tags"], FORMAT_INSTRUCTIONS["plain"], "Nothing happens."]
    if callable(getattr(env, "vocabulary", None)):
        texts += env.vocabulary(tasks)
        episodes = min(episodes, 2)
    for prompt, admissible, observation in random_play(env, tasks, episodes, history_length=history_length,
                                                       max_steps=max_steps, progress=progress,
                                                       description="tiny tokenizer: random episodes"):
        texts += [prompt, *admissible, observation]
    return texts


def warm_start(model, tokenizer, env_factory: Callable[[], TextEnv], tasks: Sequence[Mapping[str, Any]], *,
               steps: int, history_length: int = 2, max_steps: int = 8, action_mode: str = "plain",
               format_instruction: str | None = None, batch_size: int = 64, learning_rate: float = 1e-3,
               seed: int = 0, report_to: str | list[str] = "none", use_cpu: bool = False, progress: bool = False,
               output_dir: str | None = None, gradient_checkpointing: bool = True) -> dict[str, float]:
    """Fine-tune `model` in place on (prompt, admissible action) pairs of random episodes for `steps` optimizer
    steps (about one pass over fresh pairs); return its metrics. With `progress`, one `[warm start]` line at the end and
    one bar of the steps with their loss (where bars do not show, a line every 30 s: `hgpo_trl.runtime.progress`). `output_dir`: where the SFT trainer may write (its logs under
    `report_to`); None: a temporary folder.
    `gradient_checkpointing`: as the RL run's (recomputing activations costs a tiny model a third of its step).

    The completion is the action as a scripted player writes it (`format_action`): the action itself (`plain`
    mode), `<think> </think><action>A</action>` (`tags`), `<think> </think>A` (`tool`).
    """
    start = time.time()
    instruction = FORMAT_INSTRUCTIONS[action_mode] if format_instruction is None else format_instruction
    env = env_factory()
    pairs: list[tuple[str, str]] = []
    rng = random.Random(seed)  # one stream over the calls (seed + k would replay another seed's)
    tally = FaultTally("warm start: random episodes")
    try:
        while len(pairs) < steps * batch_size:
            # Episodes enough for 2 admissible actions a step; those with many (ALFWorld's dozens) stop early.
            episodes = random_play(env, tasks, max(1, (steps * batch_size - len(pairs)) // (2 * max_steps) + 1),
                                   history_length=history_length, max_steps=max_steps,
                                   format_instruction=instruction, seed=rng, progress=progress,
                                   max_pairs=2 * steps * batch_size, description=tally.description, tally=tally)
            pairs += [(prompt, action) for prompt, admissible, _ in episodes for action in admissible]
        tally.check(final=True)
    finally:
        env.close()
    answer = partial(format_action, mode=action_mode)
    dataset = sft_dataset(tokenizer, pairs, answer)
    bars = shows_bars(disabled=not progress)
    with tempfile.TemporaryDirectory(prefix="hgpo-warmstart-") as scratch, data_parallel_only():
        # One progress bar for the warm start (lines where bars do not show), its loss logged 20 times for it; no
        # per-step log dicts. The dataset comes tokenized (sft_dataset).
        config = SFTConfig(output_dir=output_dir or scratch, max_steps=steps, per_device_train_batch_size=batch_size,
                           learning_rate=learning_rate, lr_scheduler_type="constant",
                           logging_strategy="steps" if progress else "no", logging_steps=max(1, steps // 20),
                           save_strategy="no", report_to=report_to, use_cpu=use_cpu,
                           bf16=cpu_precision_default(use_cpu), seed=seed, disable_tqdm=not bars,
                           log_level="warning", gradient_checkpointing=gradient_checkpointing,
                           dataset_kwargs={"skip_prepare_dataset": True})
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
        # Our bar, without the Trainer's unlabelled dict of run statistics at the end.
        trainer.callback_handler.remove_callback(PrinterCallback)
        if bars:
            trainer.callback_handler.remove_callback(DEFAULT_PROGRESS_CALLBACK)  # (an HTML bar in a notebook)
        with closing(BarOnly("warm start", "step")) as bar:
            if progress:
                trainer.add_callback(bar)
            result = trainer.train()
    metrics = {"warmstart_loss": float(result.training_loss), "warmstart_examples": len(dataset)}
    if progress and os.environ.get("RANK", "0") == "0":  # (every process warm-starts; one line)
        tqdm.write(f"[warm start] {steps} steps on {len(dataset):,} (prompt, admissible action) pairs in "
                   f"{time.time() - start:.0f} s: loss {metrics['warmstart_loss']:.3f}")
    return metrics


@contextmanager
def without_deepspeed_config() -> Iterator[None]:
    """The RL config's DeepSpeed settings out of the way for the block: transformers and TRL read them through a
    global, by which from_pretrained partitions a model as it loads it under ZeRO-3 (a model to warm-start must
    load whole) and TRL gathers ZeRO-3 parameters."""
    from transformers.integrations import deepspeed

    rl_config = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = rl_config


@contextmanager
def data_parallel_only() -> Iterator[None]:
    """The warm start trains under plain data parallelism (DDP, or one process), whatever the launch: under a
    DeepSpeed (or FSDP) launch its Trainer would take the launch's plugin, and accelerate refuses a second
    DeepSpeed Accelerator (the RL trainer's); a DeepSpeed engine, or FSDP, also keeps the model it wraps (ZeRO-3
    partitions it, and its hooks stay). Afterwards accelerate's state is cleared, so the next Trainer sets it up
    afresh from the launch and its own use_cpu, and put back only where it was set up before (as it was). The warm
    start is for small models, which data parallelism fits."""
    launched_with = {name: os.environ.get(name) for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP")}
    device_before = PartialState._shared_state.get("_cpu")  # None: accelerate not set up yet
    os.environ.update(dict.fromkeys(launched_with, "false"))
    try:
        with without_deepspeed_config():
            yield
    finally:
        for name, value in launched_with.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
        AcceleratorState._reset_state(reset_partial_state=True)
        if device_before is not None:  # as it was (the process group stays); not set up, the next Trainer does
            PartialState(cpu=device_before)


def sft_dataset(tokenizer, pairs: Sequence[tuple[str, str]], answer: Callable[[str], str]) -> Dataset:
    """(prompt, action) pairs as SFT rows (`input_ids`, `labels` = -100 on the prompt), tokenized as TRL's
    SFTTrainer would (chat template, the completion from where prompt and prompt+completion diverge), but each
    distinct prompt rendered and tokenized once and the rest in one batch: TRL's per-row preparation took 13 s
    of a 70 s quickstart warm start (2-layer model)."""
    def chat(prompt: str, action: str | None = None) -> str:
        messages = [{"role": "user", "content": prompt}]
        if action is not None:
            messages.append({"role": "assistant", "content": answer(action)})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=action is None)

    prompts = list(dict.fromkeys(prompt for prompt, _ in pairs))
    prompt_ids = dict(zip(prompts, tokenizer([chat(p) for p in prompts], add_special_tokens=False)["input_ids"],
                          strict=True))
    full_ids = tokenizer([chat(p, a) for p, a in pairs], add_special_tokens=False)["input_ids"]
    labels = []
    for (prompt, _), ids in zip(pairs, full_ids, strict=True):
        start = common_prefix_length(prompt_ids[prompt], ids)
        labels.append([-100] * start + ids[start:])
    return Dataset.from_dict({"input_ids": full_ids, "labels": labels})
