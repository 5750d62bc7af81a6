"""The README.md written beside a trained model: what trained it, on which environment, with which estimator and
settings, how well it did on validation, how to evaluate it, and what to cite (TRL's card describes GRPO)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hgpo_trl.models.pretrained import source_description

ESTIMATOR_NAMES = {"hgpo": "HGPO (Hierarchy-of-Groups Policy Optimization)", "gigpo": "GiGPO (Group-in-Group Policy "
                   "Optimization)", "grpo": "GRPO (trajectory-level group advantages)", "progpo": "ProGPO"}

HGPO_CITATION = """@inproceedings{he2026hgpo,
  title     = {Hierarchy-of-Groups Policy Optimization for Long-Horizon Agentic Tasks},
  author    = {He, Shuo and Feng, Lang and Wei, Qi and Cheng, Xin and Feng, Lei and An, Bo},
  booktitle = {The Fourteenth International Conference on Learning Representations (ICLR)},
  year      = {2026},
  eprint    = {2602.22817},
  archivePrefix = {arXiv},
}"""

GIGPO_CITATION = """@inproceedings{feng2025gigpo,
  title     = {Group-in-Group Policy Optimization for {LLM} Agent Training},
  author    = {Feng, Lang and Xue, Zhenghai and Liu, Tingcong and An, Bo},
  booktitle = {Advances in Neural Information Processing Systems (NeurIPS)},
  year      = {2025},
  eprint    = {2505.10978},
  archivePrefix = {arXiv},
}"""


def base_model_line(base_model: str) -> tuple[str | None, str]:
    """(the hub id for the card's metadata or None, the sentence naming where training started)."""
    if not base_model:
        return None, "a model built in memory (e.g. `hgpo_trl.models.tiny.make_tiny`), not a hub checkpoint"
    if Path(base_model).expanduser().exists():
        converted = source_description(Path(base_model).expanduser())
        return None, f"{converted} (the folder `{base_model}`)" if converted else f"the local model folder `{base_model}`"
    return base_model, f"[{base_model}](https://huggingface.co/{base_model})"


def validation_lines(log_history: Sequence[Mapping[str, Any]]) -> list[str]:
    """The first and the latest evaluation in the run's log history, as Markdown lines."""
    evaluations = [h for h in log_history if "eval_success_rate" in h]
    if not evaluations:
        return ["No evaluation was run (set `eval_dataset` and an evaluation cadence)."]
    first, last = evaluations[0], evaluations[-1]
    lines = [f"Success rate on {int(last.get('eval_tasks', 0))} validation tasks (one episode each, at "
             f"`eval_temperature`): **{last['eval_success_rate']:.2f}** after iteration {last.get('iteration', '?')}"]
    if first is not last:
        lines[0] += f", from {first['eval_success_rate']:.2f} at iteration {first.get('iteration', 0)}"
    if "eval_score" in last:
        lines.append(f"Score: {last['eval_score']:.3f}")
    return [lines[0] + ".", *lines[1:]]


def write_model_card(args, *, model_name: str | None, base_model: str, log_history: Sequence[Mapping[str, Any]],
                     completed_iterations: int) -> None:
    """The card of the run configured by `args` (its HGPOConfig), with the installed libraries' versions, written
    to output_dir/README.md (`model_name`: default the output folder's name)."""
    import torch
    import transformers
    import trl

    import hgpo_trl

    card = render_model_card(
        model_name=model_name or Path(args.output_dir).name, base_model=base_model, args=args,
        estimator_options=args.estimator_options(), log_history=log_history, completed_iterations=completed_iterations,
        versions={"hgpo-trl": hgpo_trl.__version__, "TRL": trl.__version__, "Transformers": transformers.__version__,
                  "PyTorch": torch.__version__})
    path = Path(args.output_dir, "README.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(card)


def render_model_card(*, model_name: str, base_model: str, args, estimator_options: Mapping[str, Any],
                      log_history: Sequence[Mapping[str, Any]], completed_iterations: int,
                      versions: Mapping[str, str]) -> str:
    """The card's Markdown: YAML metadata, then the training, the validation result, use and citation."""
    hub_id, started = base_model_line(base_model)
    metadata = {"library_name": "transformers", "pipeline_tag": "text-generation",
                "tags": ["hgpo-trl", "trl", args.estimator, "reinforcement-learning", "llm-agent", args.env_name]}
    if hub_id:
        metadata["base_model"] = hub_id
    options = ", ".join(f"`{k}={v}`" for k, v in estimator_options.items())
    planned = f" of {args.train_iterations}" if args.train_iterations else ""
    settings = [
        ("environment", f"`{args.env_name}`" + (f" with `{dict(args.env_kwargs)}`" if args.env_kwargs else "")),
        ("estimator", f"{ESTIMATOR_NAMES.get(args.estimator, f'`{args.estimator}`')}: {options}"),
        ("prompt memory (H)", f"the last {args.history_length} (observation, action) pairs"),
        ("rollouts per task (G)", str(args.num_generations)),
        ("tasks per process and iteration", str(args.tasks_per_device)),
        ("episode step limit", str(args.max_env_steps)),
        ("iterations", f"{completed_iterations}{planned}"),
        ("learning rate, KL coefficient (beta)", f"{args.learning_rate:g}, {args.beta:g}"),
        ("action format", f"`{args.action_mode}`"),
    ]
    citations = [HGPO_CITATION] + ([GIGPO_CITATION] if args.estimator in ("gigpo", "hgpo") else [])
    framework = ", ".join(f"{name} {version}" for name, version in versions.items())
    return "\n".join([
        "---", yaml.safe_dump(metadata, sort_keys=False).strip(), "---", "",
        f"# {model_name}", "",
        f"An LLM agent trained with reinforcement learning on the `{args.env_name}` text environment by "
        f"hgpo-trl's `HGPOTrainer` (a TRL `GRPOTrainer` subclass), starting from {started}. Every "
        "environment step is one training sample with its own step-level advantage.", "",
        "## Training", "",
        "| setting | value |", "|---|---|", *[f"| {name} | {value} |" for name, value in settings], "",
        "The full configuration is the run's `summary.json` (train.py) and `training_args.bin`.", "",
        "## Validation", "", *validation_lines(log_history), "",
        "## Use", "",
        "Evaluate it on the environment's splits over several seeds, with the settings of the config it was "
        "trained with:", "",
        "```bash",
        f"hgpo-eval --config <the YAML config it was trained with> --model_name_or_path {args.output_dir}",
        "```", "",
        "Prompts are memory-window prompts (task, the last H steps, the current observation and the admissible "
        "actions), rendered by the environment; the model answers with one action.", "",
        "## Citation", "",
        "```bibtex", "\n\n".join(citations), "```", "",
        f"Trained with {framework}.", "",
    ])
