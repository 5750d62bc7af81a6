"""`evaluate.py` / `hgpo-eval`: success on an environment's evaluation splits over several seeds, as the HGPO
paper reports it, for a model or for reference players that need none.

    hgpo-eval --config configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml --model_name_or_path outputs/alfworld/run
    python evaluate.py --config configs/quickstart.yaml --model_name_or_path outputs/quickstart --greedy
    hgpo-eval --config configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml --policy random expert     # no model loaded

The config is a train.py YAML, so a model plays with the environment, prompts, action rules and generation
settings it was trained with. `model_name_or_path`: a run's output_dir or checkpoint-N folder, a LoRA adapter
folder (merged into its base in memory), any model folder or hub id, or `tiny` (built as train.py builds it).
Each task of each split (at most `num_eval_tasks`) is played once per seed at `eval_temperature` (`--greedy`:
0). Default splits: ALFWorld valid_seen (in-distribution) and valid_unseen (out-of-distribution), WebShop test
(the goals WebShop's baselines report on), keydoor valid, any other environment `eval_split`. Results: success,
WebShop's score, success per task type (ALFWorld's six), each per seed and as mean and std over the seeds, in
`evaluation.json` and `evaluation.md` under `eval_output_dir`.

Environments are stepped in batch by the training rollout (`hgpo_trl.rollout.run_rollout`; worker processes for
slow environments); generation is vLLM when `use_vllm` is set and a GPU is visible, else transformers' generate.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from tqdm.auto import tqdm
from trl import ModelConfig

from hgpo_trl.actions import format_action
from hgpo_trl.arguments import (
    TINY,
    ConfigError,
    EnvArguments,
    check_model_path,
    entry_point_scope,
    parse_sections,
)
from hgpo_trl.cli import load_model as build_training_model
from hgpo_trl.cli import load_tasks
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import TextEnv, make_env
from hgpo_trl.envs.pool import default_num_workers, make_env_batch
from hgpo_trl.envs.registry import is_fast_env
from hgpo_trl.export import ADAPTER_CONFIG, GENERIC_TOKENIZER_CLASSES
from hgpo_trl.generation import encode_prompt, generate_completions, generation_settings
from hgpo_trl.rollout import Completion, Episode, Policy, RolloutSettings, ScriptedPolicy, run_rollout
from hgpo_trl.trajectories import TASK_TYPE_FIELDS, rollout_records, write_records

POLICIES = ("model", "random", "expert")
PAPER_SEEDS = (123, 456, 789)  # the released validation seeds
DEFAULT_SPLITS = {"alfworld": ("valid_seen", "valid_unseen"), "webshop": ("test",), "keydoor": ("valid",)}
SPLIT_LABELS = {("alfworld", "valid_seen"): "in-distribution", ("alfworld", "valid_unseen"): "out-of-distribution"}


@dataclass
class EvalArguments:
    """What to evaluate and where the results go; everything else comes from the training config."""

    policy: list[str] = field(
        default_factory=lambda: ["model"],
        metadata={"help": "Players, one row each: 'model' (model_name_or_path), 'random' (uniform over the "
                          "admissible actions), 'expert' (the environment's scripted expert: ALFWorld's handcoded "
                          "one). 'random' and 'expert' load no model."})
    seeds: list[int] = field(
        default_factory=lambda: list(PAPER_SEEDS),
        metadata={"help": "Evaluation seeds (sampling, the random player, the expert's tie-breaks); mean and std "
                          "are taken over them."})
    greedy: bool = field(default=False, metadata={"help": "Greedy decoding (instead of eval_temperature)."})
    splits: list[str] | None = field(
        default=None, metadata={"help": "Task splits to evaluate (default: alfworld valid_seen valid_unseen, webshop "
                                        "test, keydoor valid, other environments eval_split)."})
    num_envs: int | None = field(
        default=None, metadata={"help": "Environments played at once (default: tasks_per_device x num_generations, "
                                        "as a training rollout)."})
    episodes_per_seed: int | None = field(
        default=None, metadata={"help": "Play this many episodes per split and seed, cycling through all of the "
                                        "split's tasks (num_eval_tasks is then not read); the released evaluation "
                                        "plays 512 (4 x 128). None: every task once."})
    eval_output_dir: str | None = field(
        default=None, metadata={"help": "Folder of evaluation.json and evaluation.md; default: 'evaluation' beside "
                                        "the evaluated model (inside its folder), or the config's "
                                        "output_dir/evaluation for a hub id, 'tiny' or reference players only. A "
                                        "folder that already holds a result is never overwritten: the next free "
                                        "evaluation-N is used, and said."})


@dataclass
class Evaluation:
    """A checked command line: everything a run needs, nothing loaded yet but the task lists."""

    eval_args: EvalArguments
    env_args: EnvArguments
    args: HGPOConfig
    model_args: ModelConfig
    tasks: dict[str, list[dict[str, Any]]]  # split -> task rows
    temperature: float
    output_dir: Path


def prepare(argv: list[str] | None = None) -> Evaluation:
    """Parse and check the command line; every problem is a ConfigError naming it, raised before any model loads."""
    eval_args, env_args, args, model_args = parse_sections(cpu_overrides(argv), (EvalArguments,), "evaluate.py")
    unknown = sorted(set(eval_args.policy) - set(POLICIES))
    if unknown or not eval_args.policy:
        raise ConfigError(f"EvalArguments.policy must be one or more of {POLICIES}, got {eval_args.policy}")
    if not eval_args.seeds or len(set(eval_args.seeds)) != len(eval_args.seeds):
        raise ConfigError(f"EvalArguments.seeds must be one or more distinct integers, got {eval_args.seeds}")
    if eval_args.num_envs is not None and eval_args.num_envs < 1:
        raise ConfigError(f"EvalArguments.num_envs must be None or an integer >= 1, got {eval_args.num_envs}")
    if "model" in eval_args.policy:
        check_model_path(model_args.model_name_or_path)
    splits = eval_args.splits or DEFAULT_SPLITS.get(args.env_name, (env_args.eval_split,))
    if None in splits:
        raise ConfigError(f"EvalArguments.splits: environment {args.env_name!r} has no default evaluation split and "
                          "eval_split is None; name the splits with --splits")
    if eval_args.episodes_per_seed is not None and eval_args.episodes_per_seed < 1:
        raise ConfigError(f"EvalArguments.episodes_per_seed must be None or an integer >= 1, got "
                          f"{eval_args.episodes_per_seed}")
    episodes = eval_args.episodes_per_seed
    tasks = {}
    for split in splits:
        try:
            rows = list(load_tasks(args, env_args, split, None if episodes else env_args.num_eval_tasks))
            tasks[split] = (rows * -(-episodes // len(rows)))[:episodes] if episodes else rows
        except ValueError as err:
            raise ConfigError(f"EvalArguments.splits: environment {args.env_name!r} has no split {split!r} "
                              f"to evaluate ({err})") from None
    if "expert" in eval_args.policy:  # (after the tasks: a data problem is reported as one, not as this)
        try:
            make_env(args.env_name, **{**(args.env_kwargs or {}), "expert": True}).close()
        except ValueError as err:
            raise ConfigError(f"EvalArguments.policy expert: environment {args.env_name!r} has no scripted expert "
                              f"(make_env(..., expert=True) giving info['expert_action']): {err}") from None
    output_dir = result_folder(eval_args, args, model_args)
    temperature = 0.0 if eval_args.greedy else args.eval_temperature
    return Evaluation(eval_args, env_args, args, model_args, tasks, temperature, output_dir)


def cpu_overrides(argv: list[str] | None) -> list[str]:
    """The command line, with `--use_vllm false --bf16 false` added (unless given) where no GPU is visible or
    only reference players play: a paper config evaluates on a CPU with transformers' generate, as documented."""
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    model_plays = "--policy" not in argv or "model" in argv[argv.index("--policy") + 1:]
    if model_plays and torch.cuda.is_available():
        return argv
    added = [f"--{name}" for name in ("use_vllm", "bf16") if f"--{name}" not in argv]
    path = Path(argv[argv.index("--config") + 1]) if "--config" in argv[:-1] else None
    try:  # (a config that cannot be read is reported by the parser, next)
        config = yaml.safe_load(path.read_text()) if path is not None and path.is_file() else {}
    except yaml.YAMLError:
        config = {}
    turned_off = [name[2:] for name in added if isinstance(config, dict) and config.get(name[2:]) is True]
    if model_plays and turned_off:
        print(f"evaluate.py: no GPU visible: the model generates with transformers on the CPU "
              f"({' and '.join(turned_off)} off)")
    return [*argv, *(item for name in added for item in (name, "false"))]


def result_folder(eval_args: EvalArguments, args: HGPOConfig, model_args: ModelConfig) -> Path:
    """Where the report goes: `eval_output_dir`, else `evaluation` in the evaluated model's folder, else in the
    config's output_dir; a folder that holds a report already gives way to the next free `evaluation-N`."""
    model = Path(model_args.model_name_or_path or "").expanduser()
    if eval_args.eval_output_dir:
        folder = Path(eval_args.eval_output_dir)
    elif "model" in eval_args.policy and model_args.model_name_or_path != TINY and model.is_dir():
        folder = model / "evaluation"
    else:
        folder = Path(args.output_dir) / "evaluation"
    if not (folder / "evaluation.json").exists():
        return folder
    free = next(folder.with_name(f"{folder.name}-{n}") for n in itertools.count(1)
                if not (folder.with_name(f"{folder.name}-{n}") / "evaluation.json").exists())
    print(f"evaluate.py: {folder} already holds an evaluation; writing this one to {free}")
    return free


# ---------------------------------------------------------------------------------------------- players
def random_player(seed: int, action_mode: str) -> ScriptedPolicy:
    """Uniform over each environment's admissible actions, from its own RNG: the same seed, the same games."""
    rng = random.Random(seed)

    def play(prompts: list[str], infos: list[Mapping[str, Any]]) -> list[Completion]:
        return [Completion(format_action(rng.choice(info["admissible_actions"]), action_mode)) for info in infos]

    return play


def expert_player(action_mode: str) -> ScriptedPolicy:
    """The environment's own expert (`expert=True`: ALFWorld's handcoded one puts its next action in the info)."""

    def play(prompts: list[str], infos: list[Mapping[str, Any]]) -> list[Completion]:
        return [Completion(format_action(info["expert_action"], action_mode)) for info in infos]

    return play


class ModelPolicy:
    """A model as a rollout policy: each turn's prompts go to one `generate(prompt_ids) -> completion_ids` call,
    encoded as the trainer encodes them (the chat template with its generation prompt, when there is one)."""

    def __init__(self, tokenizer, generate: Callable[[list[list[int]]], list[list[int]]],
                 chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer, self.generate = tokenizer, generate
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._encoded: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text, self.chat_template_kwargs)

    def count_tokens(self, text: str) -> int:
        # The rollout counts tokens to fit each prompt to the context: keep the ids for generation.
        self._encoded[text] = self.encode(text)
        return len(self._encoded[text])

    def __call__(self, prompts: list[str]) -> list[Completion]:
        prompt_ids = [self._encoded[p] if p in self._encoded else self.encode(p) for p in prompts]
        self._encoded.clear()  # this turn's fitting attempts
        if not prompts:
            return []
        completion_ids = self.generate(prompt_ids)
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return [Completion(text=text, prompt_ids=p, completion_ids=c)
                for text, p, c in zip(texts, prompt_ids, completion_ids, strict=True)]


def load_tokenizer(name: str, **kwargs: Any):
    """AutoTokenizer, except for a tokenizer saved as a bare tokenizer.json (the tiny word-level one, as a run saves
    it): next to a qwen2 config.json AutoTokenizer would rebuild it as a byte-level BPE and garble every prompt."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_file = Path(name).expanduser() / "tokenizer_config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(name)
    return AutoTokenizer.from_pretrained(name, **kwargs)


def load_model(model_args: ModelConfig, env_args: EnvArguments, args: HGPOConfig):
    """(model, tokenizer) of model_name_or_path: 'tiny' built for the environment's training tasks as train.py
    builds it, a LoRA adapter folder merged into its base, or a model folder / hub id."""
    from transformers import AutoModelForCausalLM

    name = model_args.model_name_or_path
    if name == TINY:
        train_tasks = load_tasks(args, env_args, env_args.train_split, env_args.num_train_tasks)
        return build_training_model(model_args, env_args, args, train_tasks)
    options = {"dtype": model_args.dtype or "auto", "attn_implementation": model_args.attn_implementation,
               "trust_remote_code": args.trust_remote_code}
    folder = Path(name).expanduser()
    if (folder / ADAPTER_CONFIG).is_file():
        from peft import AutoPeftModelForCausalLM

        # Merged once here: generation then runs at the base model's speed.
        model = AutoPeftModelForCausalLM.from_pretrained(folder, **options).merge_and_unload()
        has_tokenizer = (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file()
        base = json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
        return model, load_tokenizer(str(folder) if has_tokenizer else base)
    model = AutoModelForCausalLM.from_pretrained(name, revision=model_args.model_revision, **options)
    return model, load_tokenizer(name, revision=model_args.model_revision, trust_remote_code=args.trust_remote_code)


def eos_token_ids(declared: int | list[int] | None, tokenizer) -> list[int]:
    """Every end token the model declares (its generation config's), and the tokenizer's, as TRL stops completions."""
    ids = [declared] if isinstance(declared, int) else list(declared or [])
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def hf_generator(model, tokenizer, args: HGPOConfig, temperature: float):
    """transformers' generate on a whole turn (left-padded), with the config's sampling settings; the global torch
    RNG (seeded per evaluation seed) drives sampling."""
    import torch
    from transformers import GenerationConfig

    device = "cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu"
    model.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = eos_token_ids(model.generation_config.eos_token_id, tokenizer)
    # Sampling settings only when sampling: greedy decoding would warn that they are ignored.
    sampling = {"do_sample": True, "temperature": temperature, "top_p": args.top_p, "top_k": args.top_k,
                "min_p": args.min_p} if temperature > 0 else {"do_sample": False}
    config = GenerationConfig(**{"max_new_tokens": args.max_completion_length,
                                 "repetition_penalty": args.repetition_penalty, "pad_token_id": tokenizer.pad_token_id,
                                 "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, **sampling,
                                 **(args.generation_kwargs or {})})

    def generate(prompt_ids: list[list[int]]) -> list[list[int]]:
        return generate_completions(model, config, prompt_ids, tokenizer.pad_token_id, eos)

    return generate


def vllm_generator(model_path: str, tokenizer, args: HGPOConfig, model_args: ModelConfig, temperature: float):
    """vLLM in this process on token ids (its own tokenizer is never loaded); each request gets a seed drawn from
    Python's `random` (seeded per evaluation seed), so a seed gives the same completions."""
    from transformers import GenerationConfig
    from vllm import LLM, SamplingParams

    try:
        declared = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        declared = None
    eos = eos_token_ids(declared, tokenizer)
    llm = LLM(model=model_path, skip_tokenizer_init=True, dtype=model_args.dtype or "auto",
              tensor_parallel_size=args.vllm_tensor_parallel_size,
              gpu_memory_utilization=args.vllm_gpu_memory_utilization, max_model_len=args.vllm_max_model_length,
              trust_remote_code=args.trust_remote_code)

    def generate(prompt_ids: list[list[int]]) -> list[list[int]]:
        params = [SamplingParams(**{"n": 1, "temperature": temperature, "top_p": args.top_p, "top_k": args.top_k,
                                    "min_p": args.min_p or 0.0, "repetition_penalty": args.repetition_penalty,
                                    "max_tokens": args.max_completion_length, "stop_token_ids": eos,
                                    "detokenize": False, "seed": random.randrange(2**31),
                                    **(args.generation_kwargs or {})}) for _ in prompt_ids]
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    return generate


def model_policy(evaluation: Evaluation, settings: RolloutSettings) -> tuple[ModelPolicy, RolloutSettings, str]:
    """The policy of model_name_or_path, the rollout settings with its prompt budget, and the backend's name."""
    import torch

    args, model_args = evaluation.args, evaluation.model_args
    name = model_args.model_name_or_path
    adapter = (Path(name).expanduser() / ADAPTER_CONFIG).is_file()
    if args.use_vllm and name != TINY and torch.cuda.is_available():
        from transformers import AutoConfig

        if adapter:  # vLLM reads a model folder: merge the adapter into one
            from hgpo_trl.export import merge_adapter

            name = str(merge_adapter(name, evaluation.output_dir / "merged_model"))
        model_config = AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code)
        tokenizer = load_tokenizer(name, trust_remote_code=args.trust_remote_code)
        generate = vllm_generator(name, tokenizer, args, model_args, evaluation.temperature)
        backend = "vllm"
    else:
        if args.use_vllm:
            print("evaluate.py: use_vllm is set, but vLLM runs on a GPU and not the tiny model: generating with "
                  "transformers")
        model, tokenizer = load_model(model_args, evaluation.env_args, args)
        model_config = model.config
        generate = hf_generator(model, tokenizer, args, evaluation.temperature)
        backend = "transformers"
    settings = generation_settings(settings, tokenizer, model_config,
                                   args.vllm_max_model_length if backend == "vllm" else None, args.max_completion_length)
    return ModelPolicy(tokenizer, generate, args.chat_template_kwargs), settings, backend


# ---------------------------------------------------------------------------------------------- playing
def seeded_env(seed: int, name: str, kwargs: Mapping[str, Any]) -> TextEnv:
    """A new environment, with Python's global `random` seeded in the process that steps it (a worker, for slow
    environments): ALFWorld's expert breaks ties with it."""
    random.seed(seed)
    return make_env(name, **kwargs)


def play(envs, tasks: Sequence[Mapping[str, Any]], player: Policy | ScriptedPolicy, settings: RolloutSettings, *,
         scripted: bool, count_tokens: Callable[[str], int] | None, description: str, quiet: bool,
         dump: Path | None, args: HGPOConfig) -> list[Episode]:
    """Every task played once, len(envs) at a time; the episodes in task order. A progress bar counts the games
    done and the success so far; `dump` receives the trajectories (hgpo_trl.trajectories reads them)."""
    episodes: list[Episode] = []
    records: list[dict[str, Any]] = []
    with tqdm(total=len(tasks), desc=description, unit="game", disable=quiet, dynamic_ncols=True) as bar:
        ended = wins = 0  # (a disabled bar counts nothing)

        def on_episode_end(episode: Episode) -> None:
            nonlocal ended, wins
            ended, wins = ended + 1, wins + episode.won
            bar.update(1)
            bar.set_postfix(success=f"{wins / ended:.3f}")

        for start in range(0, len(tasks), len(envs)):
            chunk = list(tasks[start:start + len(envs)])
            rollout = run_rollout(envs, chunk, 1, player, settings, on_episode_end=on_episode_end,
                                  count_tokens=count_tokens, scripted=scripted)
            episodes += rollout.episodes  # one rollout per task: episode k played chunk[k]
            if dump is not None:
                for record in rollout_records(rollout, chunk, None, gamma=args.gamma,
                                              invalid_penalty=args.invalid_penalty, depth=args.depth):
                    record["episode"] += start  # numbered across chunks, so a reader keeps episodes apart
                    records.append(record)
    if dump is not None:
        write_records(dump, records)
    return episodes


def seed_outcome(seed: int, tasks: Sequence[Mapping[str, Any]], episodes: Sequence[Episode]) -> dict[str, Any]:
    """One seed's row: success (an environment fault counts as a failure), score when the environment grades
    outcomes, episode length, invalid outputs, faults, and success per task type when tasks have one."""
    won = np.array([e.won for e in episodes], dtype=float)
    steps = sum(e.steps for e in episodes)
    row: dict[str, Any] = {"seed": seed, "success_rate": float(won.mean()),
                           "episode_length": steps / len(episodes),
                           "invalid_rate": sum(e.invalid for e in episodes) / max(steps, 1),
                           "faults": sum(e.fault is not None for e in episodes)}
    if any(e.score is not None for e in episodes):
        row["score"] = float(np.mean([e.score or 0.0 for e in episodes]))
    types = np.array([task_type(task) for task in tasks])
    if all(types):
        row["task_types"] = {t: float(won[types == t].mean()) for t in sorted(set(types))}
    return row


def task_type(task: Mapping[str, Any]) -> str:
    """The task row's own type (ALFWorld's `task_type`), "" when it has none."""
    return next((str(task[f]) for f in TASK_TYPE_FIELDS if f in task), "")


def mean_std(values: Sequence[float]) -> dict[str, float]:
    """Mean and population std over seeds."""
    return {"mean": float(np.mean(values)), "std": float(np.std(values))}


def summarize(env_name: str, policy: str, split: str, tasks: Sequence[Mapping[str, Any]],
              rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {"policy": policy, "split": split, "label": SPLIT_LABELS.get((env_name, split)),
                              "tasks": len(tasks), "success_rate": mean_std([r["success_rate"] for r in rows])}
    if all("score" in r for r in rows):
        result["score"] = mean_std([r["score"] for r in rows])
    if all("task_types" in r for r in rows):
        types = [task_type(task) for task in tasks]
        result["task_types"] = {t: {"tasks": types.count(t), **mean_std([r["task_types"][t] for r in rows])}
                                for t in rows[0]["task_types"]}
    result["seeds"] = list(rows)
    return result


def run(evaluation: Evaluation) -> dict[str, Any]:
    """Play every split with every player and seed; write evaluation.json and evaluation.md; return the result."""
    from transformers import set_seed

    start = time.time()
    eval_args, args = evaluation.eval_args, evaluation.args
    settings = args.rollout_settings()
    scripted_settings = dataclasses.replace(settings, max_prompt_tokens=None)  # their prompts are never read
    model, model_settings, backend = (model_policy(evaluation, settings) if "model" in eval_args.policy
                                      else (None, settings, None))
    largest = max(len(tasks) for tasks in evaluation.tasks.values())
    num_envs = min(eval_args.num_envs or args.tasks_per_device * args.num_generations, largest)
    workers = args.env_workers if args.env_workers is not None else (
        0 if is_fast_env(args.env_name) else default_num_workers())
    dumps = evaluation.output_dir / "trajectories" if args.trajectory_dump_every else None
    results = []
    for policy in eval_args.policy:
        env_kwargs = {**(args.env_kwargs or {}), **({"expert": True} if policy == "expert" else {})}
        rows: dict[str, list[dict[str, Any]]] = {split: [] for split in evaluation.tasks}
        for seed in eval_args.seeds:
            set_seed(seed)  # Python, numpy and torch: sampling is the same for the same seed
            player = {"model": model, "random": random_player(seed, settings.action_mode),
                      "expert": expert_player(settings.action_mode)}[policy]
            # New environments per seed: an expert's tie-breaks restart from the seed.
            with make_env_batch(partial(seeded_env, seed, args.env_name, env_kwargs), num_envs, workers,
                                step_timeout=args.env_step_timeout, reset_timeout=args.env_reset_timeout) as envs:
                for split, tasks in evaluation.tasks.items():
                    episodes = play(envs, tasks, player, model_settings if policy == "model" else scripted_settings,
                                    scripted=policy != "model",
                                    count_tokens=model.count_tokens if policy == "model" else None,
                                    description=f"{policy} {split} seed {seed}", quiet=args.disable_tqdm,
                                    dump=dumps / f"{policy}_{split}_seed{seed}.jsonl" if dumps else None, args=args)
                    rows[split].append(seed_outcome(seed, tasks, episodes))
        results += [summarize(args.env_name, policy, split, evaluation.tasks[split], rows[split])
                    for split in evaluation.tasks]
    report = {
        "env": args.env_name,
        "model": evaluation.model_args.model_name_or_path if "model" in eval_args.policy else None,
        "backend": backend, "temperature": evaluation.temperature, "seeds": list(eval_args.seeds),
        "max_env_steps": args.max_env_steps, "num_eval_tasks": evaluation.env_args.num_eval_tasks,
        "results": results, "wall_seconds": round(time.time() - start, 1),
    }
    write_report(report, evaluation.output_dir)
    return report


# ---------------------------------------------------------------------------------------------- report
def _percent(value: dict[str, float] | float) -> str:
    if isinstance(value, dict):
        return f"{100 * value['mean']:.1f} ± {100 * value['std']:.1f}"
    return f"{100 * value:.1f}"


def markdown(report: Mapping[str, Any]) -> str:
    """The results as a Markdown table in percent, the paper's unit: a row per seed, then mean ± std."""
    results = report["results"]
    types = sorted({t for r in results for t in r.get("task_types", {})})
    scored = any("score" in r for r in results)
    header = ["policy", "split", "seed", "tasks", "success", *(["score"] if scored else []), *types]
    model = f"model `{report['model']}` ({report['backend']}), " if report["model"] else ""
    lines = [f"# Evaluation on {report['env']}", "",
             f"{model}temperature {report['temperature']}, seeds {', '.join(map(str, report['seeds']))}, at most "
             f"{report['max_env_steps']} steps. Success{' and score' if scored else ''} in %; mean ± std "
             "(population) over the seeds.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        split = f"{r['split']} ({r['label']})" if r["label"] else r["split"]
        for row in [*r["seeds"], None]:
            source = r if row is None else row  # None: the mean ± std row
            cells = [r["policy"], split, "mean ± std" if row is None else str(row["seed"]), str(r["tasks"]),
                     _percent(source["success_rate"])]
            if scored:
                cells.append(_percent(source["score"]) if "score" in source else "–")
            cells += [_percent(source["task_types"][t]) if t in source.get("task_types", {}) else "–" for t in types]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(report: Mapping[str, Any], output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "evaluation.json").write_text(json.dumps(report, indent=2) + "\n")
    (output_dir / "evaluation.md").write_text(markdown(report))


def main(argv: list[str] | None = None) -> None:
    with entry_point_scope():
        try:
            evaluation = prepare(argv)
        except ConfigError as err:
            print(f"evaluate.py: configuration error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        report = run(evaluation)
    for r in report["results"]:
        score = f", score {_percent(r['score'])}" if "score" in r else ""
        print(f"{r['policy']} on {r['split']}: success {_percent(r['success_rate'])}{score} % over "
              f"{len(report['seeds'])} seed{'s' * (len(report['seeds']) != 1)}")
    print(f"wrote {evaluation.output_dir / 'evaluation.json'} and evaluation.md")


if __name__ == "__main__":
    main()
