"""Who plays an evaluation: the reference players that need no model (uniform over the admissible actions, the
environment's scripted expert) and a model, loaded as `hgpo-eval` takes it (a run's folder, a LoRA adapter merged
into its base, a hub id, or `tiny` built as train.py builds it) and generating with transformers or vLLM."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trl import ModelConfig

from hgpo_trl.commands.arguments import TINY, EnvArguments
from hgpo_trl.commands.parser import command_name
from hgpo_trl.commands.train import load_model as build_training_model
from hgpo_trl.commands.train import load_tasks
from hgpo_trl.config import HGPOConfig
from hgpo_trl.models.export import ADAPTER_CONFIG, GENERIC_TOKENIZER_CLASSES
from hgpo_trl.rollout.actions import format_action
from hgpo_trl.rollout.generation import Generate, ModelPolicy, generate_completions, generation_settings
from hgpo_trl.rollout.lockstep import Completion, RolloutSettings, ScriptedPolicy
from hgpo_trl.rollout.vllm_cpu import cpu_engine_args, vllm_runs_here, vllm_starting
from hgpo_trl.runtime.progress import transformers_bars_as_ours


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


def hf_generator(model, tokenizer, args: HGPOConfig, temperature: float, device: str) -> Generate:
    """transformers' generate on `device` on a whole turn (left-padded; with eos where the tokenizer has no pad
    token, which is left as it is: it may be the caller's), with the config's sampling settings; the global torch
    RNG (seeded per evaluation seed) drives sampling."""
    from transformers import GenerationConfig

    model.to(device).eval()
    pad_token_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    eos = eos_token_ids(model.generation_config.eos_token_id, tokenizer)
    # Sampling settings only when sampling: greedy decoding would warn that they are ignored.
    sampling = {"do_sample": True, "temperature": temperature, "top_p": args.top_p, "top_k": args.top_k,
                "min_p": args.min_p} if temperature > 0 else {"do_sample": False}
    config = GenerationConfig(**{"max_new_tokens": args.max_completion_length,
                                 "repetition_penalty": args.repetition_penalty, "pad_token_id": pad_token_id,
                                 "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, **sampling,
                                 **(args.generation_kwargs or {})})

    def generate(prompt_ids: list[list[int]]) -> tuple[list[list[int]], None]:
        return generate_completions(model, config, prompt_ids, pad_token_id, eos), None

    return generate


def vllm_generator(model_path: str, tokenizer, args: HGPOConfig, model_args: ModelConfig,
                   temperature: float) -> Generate:
    """vLLM in this process on token ids (its own tokenizer is never loaded); each request gets a seed drawn from
    Python's `random` (seeded per evaluation seed), so a seed gives the same completions."""
    from transformers import GenerationConfig
    from vllm import LLM, SamplingParams

    try:
        declared = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        declared = None
    eos = eos_token_ids(declared, tokenizer)
    with vllm_starting(True):
        llm = LLM(model=model_path, skip_tokenizer_init=True, dtype=model_args.dtype or "auto",
                  tensor_parallel_size=args.vllm_tensor_parallel_size,
                  gpu_memory_utilization=args.vllm_gpu_memory_utilization, max_model_len=args.vllm_max_model_length,
                  trust_remote_code=args.trust_remote_code,
                  **cpu_engine_args(model_path, args.vllm_max_model_length, None, args.trust_remote_code))

    def generate(prompt_ids: list[list[int]]) -> tuple[list[list[int]], None]:
        params = [SamplingParams(**{"n": 1, "temperature": temperature, "top_p": args.top_p, "top_k": args.top_k,
                                    "min_p": args.min_p or 0.0, "repetition_penalty": args.repetition_penalty,
                                    "max_tokens": args.max_completion_length, "stop_token_ids": eos,
                                    "detokenize": False, "seed": random.randrange(2**31),
                                    **(args.generation_kwargs or {})}) for _ in prompt_ids]
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs], None

    return generate


def model_policy(args: HGPOConfig, model_args: ModelConfig, env_args: EnvArguments, temperature: float,
                 settings: RolloutSettings, output_dir: Path, loaded: tuple[Any, Any] | None = None
                 ) -> tuple[ModelPolicy, RolloutSettings, str]:
    """The policy of model_name_or_path (or of the `loaded` (model, tokenizer) in memory), the rollout settings
    with its prompt budget, and the backend's name (an adapter that vLLM plays is merged into
    `output_dir/merged_model` first)."""
    import torch

    name = model_args.model_name_or_path
    adapter = loaded is None and (Path(name).expanduser() / ADAPTER_CONFIG).is_file()
    if args.use_vllm and loaded is None and name != TINY and vllm_runs_here():
        from transformers import AutoConfig

        if adapter:  # vLLM reads a model folder: merge the adapter into one
            from hgpo_trl.models.export import merge_adapter

            name = str(merge_adapter(name, output_dir / "merged_model"))
        model_config = AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code)
        tokenizer = load_tokenizer(name, trust_remote_code=args.trust_remote_code)
        generate = vllm_generator(name, tokenizer, args, model_args, temperature)
        backend = "vllm"
    else:
        if args.use_vllm:
            print(f"{command_name('evaluate.py')}: use_vllm is set, but vLLM plays a model folder (on a GPU, or on the CPU with "
                  "vllm-cpu), not the tiny model or one in memory: generating with transformers")
        with transformers_bars_as_ours(args.disable_tqdm):  # ("Loading weights" into a log)
            model, tokenizer = loaded or load_model(model_args, env_args, args)
        model_config = model.config
        generate = hf_generator(model, tokenizer, args, temperature,
                                "cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu")
        backend = "transformers"
    settings = generation_settings(settings, tokenizer, model_config,
                                   args.vllm_max_model_length if backend == "vllm" else None, args.max_completion_length)
    return ModelPolicy(tokenizer, generate, args.chat_template_kwargs), settings, backend

