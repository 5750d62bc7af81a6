"""HGPOConfig's own fields, with their help: a plain dataclass that imports neither torch nor TRL, so that
`train.py --help` lists them in a second (`HGPOConfig` adds them to TRL's `GRPOConfig`, with the checks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class HGPOFields:
    """The environment, memory-window, step-batching and estimator settings of `HGPOConfig`, and the TRL defaults
    it changes (`logging_steps`, `report_to`)."""

    # Environment
    env_name: str = field(default="keydoor", metadata={"help": "Registered environment name (hgpo_trl.envs.make_env)."})
    env_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments of the environment factory, e.g. {key_reward: 3.0}; on "
                                        "the command line (YAML or JSON) it replaces the YAML's mapping as a whole."})
    tasks_per_device: int = field(
        default=2, metadata={"help": "Distinct tasks each process plays per iteration, each num_generations times."})
    max_env_steps: int = field(default=50, metadata={"help": "Step limit of an episode (ALFWorld 50, WebShop 30)."})
    env_workers: int | None = field(
        default=None, metadata={"help": "Worker processes stepping this process's environments; 0 steps them "
                                        "in-process (no timeout can hold there); None: in-process for fast envs, "
                                        "else one per core of this process's share of its node."})
    env_step_timeout: float | None = field(
        default=None, metadata={"help": "Seconds a worker may take for one step call before its episodes fail."})
    env_reset_timeout: float | None = field(
        default=None, metadata={"help": "Seconds a worker may take for one reset call (and to start)."})
    rollout_mode: str = field(
        default="auto", metadata={"help": "How a rollout's episodes advance: 'lockstep' (as released: each turn "
                                          "generates every live episode's prompt in one call, then steps every "
                                          "environment), 'continuous' (each episode on its own: its next prompt "
                                          "goes to the engine as soon as its environment answers, environments "
                                          "step in their workers while the engine generates; the same step "
                                          "records; colocated vLLM without tensor parallelism or sleep mode, or "
                                          "transformers without ZeRO-3 / FSDP) or 'auto' (continuous with "
                                          "colocated vLLM where it has time to win back: environments in worker "
                                          "processes, or completions over 16 tokens; else lockstep)."})
    async_generation: bool = field(
        default=False, metadata={"help": "Generate beside training: a thread plays the coming iterations' rollouts on "
                                         "a vLLM server (vllm_mode 'server', rollout_mode 'continuous') while the "
                                         "trainer "
                                         "trains, the weights pushed after each optimizer step; each step records "
                                         "the weights it was generated with, and vLLM's importance-sampling "
                                         "correction reweights it (docs/trainer.md). Needs fixed_budget with one "
                                         "optimizer step an iteration."})
    max_staleness: int = field(
        default=1, metadata={"help": "With async_generation: the most optimizer steps between the weights a step "
                                     "was generated with and the update that trains it. An iteration is played only "
                                     "once the server holds weights that recent (nothing is dropped, so long "
                                     "episodes are not lost); 0: the synchronous run, exactly."})
    vllm_request_timeout: float = field(
        default=600.0, metadata={"help": "vllm_mode 'server': seconds a request may wait for its completion before the "
                                         "run stops, naming the server (a server that hangs would otherwise hang "
                                         "the run; one that refuses connections is named after ~6 s of retries)."})
    max_faulty_iterations: int = field(
        default=3, metadata={"help": "Stop (after saving a checkpoint) when this many iterations in a row have more "
                                     "than half their episodes failed by environment faults; 0: never stop."})
    train_iterations: int | None = field(
        default=None, metadata={"help": "Rollout iterations to train for; sets max_steps (optimizer steps) from it "
                                        "(under all_steps, an upper bound: iterations stop the run)."})
    dynamic_sampling: bool = field(
        default=False, metadata={"help": "Drop each task group whose num_generations episodes all got the same "
                                         "environment reward (before the invalid-action penalty, as released: "
                                         "no outcome to compare) and play more rollout batches "
                                         "until the kept groups fill the iteration's tasks over all processes, at "
                                         "most max_rollout_batches, the last one kept unfiltered: released "
                                         "algorithm.filter_groups (DAPO's dynamic sampling), for every estimator. "
                                         "env/* metrics then cover the kept groups, as released; dynamic/* the "
                                         "batches."})
    max_rollout_batches: int = field(
        default=10, metadata={"help": "dynamic_sampling: rollout batches an iteration may play (released "
                                      "max_num_gen_batches: 10 in verl-agent's ppo_trainer.yaml; the HGPO "
                                      "recipe's config sets 0, with filter_groups off)."})
    dynamic_sampling_tasks: str = field(
        default="fresh", metadata={"help": "dynamic_sampling: the tasks of each extra batch: 'fresh' (new tasks "
                                           "from a seeded stream of their own, its position saved in checkpoints; "
                                           "in effect the release's on ALFWorld and WebShop, whose environments draw "
                                           "new games at every reset) or 'replay' (the iteration's tasks again: the "
                                           "release replays its batch of prompts)."})

    # Step samples and optimizer steps
    step_batching: str = field(
        default="fixed_budget", metadata={
            "help": "'fixed_budget': per_device_train_batch_size x steps_per_generation step samples per process "
                    "and iteration (drawn from the steps, or padded), one pass of TRL's buffer; 'all_steps' (as "
                    "released): every collected step is trained once per iteration, in mini-batches of "
                    "mini_batch_size with one optimizer step each, as many as the steps fill."})
    mini_batch_size: int | None = field(
        default=None, metadata={"help": "all_steps: step samples per optimizer step over all processes (released "
                                        "ppo_mini_batch_size); sets gradient_accumulation_steps to mini_batch_size "
                                        "/ (per_device_train_batch_size x processes). None: per_device_train_"
                                        "batch_size x gradient_accumulation_steps x processes."})
    fill_last_micro_batch: str = field(
        default="pad", metadata={"help": "all_steps: 'pad' leaves each process's last micro-batch short (every step "
                                         "trained exactly once); 'duplicate' fills it with copies of random steps of "
                                         "the iteration, as released (adjust_batch, mode 'copy')."})
    balance_steps: bool = field(
        default=False, metadata={"help": "all_steps: after the advantages, share the iteration's step rows out so "
                                         "that every process trains the same number, token counts balanced, and "
                                         "every optimizer step exactly mini_batch_size rows, as released "
                                         "(balance_batch); False: each process trains the steps it played."})
    balance_partition: str = field(
        default="greedy", metadata={"help": "balance_steps: how the rows are split over the processes: 'greedy' "
                                            "(longest row first, to the set with the fewest tokens that has room) "
                                            "or 'karmarkar_karp' (as released: verl's get_seqlen_balanced_"
                                            "partitions, equal_size, which decides which rows share a micro-batch "
                                            "and an optimizer step)."})
    fill_multiple: int | None = field(
        default=None, metadata={"help": "all_steps with balance_steps and fill_last_micro_batch 'duplicate': fill "
                                        "the iteration's rows over all processes to a multiple of this many "
                                        "(released adjust_batch: the lcm of the log-prob and actor micro-batches "
                                        "x GPUs). None: per_device_train_batch_size x processes."})
    train_forced_steps: bool = field(
        default=True, metadata={"help": "fixed_budget: False leaves forced steps (the environment listed exactly "
                                        "one admissible action and the step took it) out of the draw, so the "
                                        "budget's rows go to decisions; their advantages and groups are "
                                        "computed as before. True: any step can be drawn (as released)."})
    shuffle_steps: bool = field(
        default=False, metadata={"help": "all_steps: train an iteration's steps in a random order instead of "
                                         "rollout order (released: rollout order)."})
    eval_every_iterations: int | None = field(
        default=None, metadata={"help": "Evaluate after every this many iterations (needs eval_dataset); replaces "
                                        "eval_strategy / eval_steps, which count optimizer steps."})
    save_every_iterations: int | None = field(
        default=None, metadata={"help": "Save a checkpoint after every this many iterations (and at the end); "
                                        "replaces save_strategy / save_steps, which count optimizer steps."})

    # Prompting and actions
    history_length: int = field(
        default=2, metadata={"help": "H: earlier (observation, action) pairs shown in each step's prompt."})
    action_mode: str = field(
        default="tags", metadata={"help": "'tags': answer inside <action></action> after <think></think> "
                                          "(as released); 'plain': the whole completion is the action; 'tool': "
                                          "a tool call after <think></think> (env_name trl, TRL classes)."})
    require_think: bool = field(default=True, metadata={"help": "tags and tool modes: require a <think></think> block."})
    reject_cjk: bool = field(default=True, metadata={"help": "Treat outputs with CJK characters as invalid."})
    invalid_action: str = field(
        default="noop", metadata={"help": "What an invalid output does: 'noop' (the env does nothing, the episode "
                                          "goes on), 'end_episode' (the episode ends as failed) or 'execute' (as "
                                          "released, verl-agent's projection: tags are found anywhere, a penalised "
                                          "output's action is still sent, an output with no action block sends "
                                          "its last characters; tags mode only)."})
    invalid_penalty: float = field(default=0.1, metadata={"help": "Return penalty of each invalid step."})
    admissible_only: bool = field(
        default=False, metadata={"help": "Count an action outside the environment's admissible list as invalid "
                                         "(helps tiny models; the papers send such actions to the env)."})
    format_instruction: str | None = field(
        default=None, metadata={"help": "Answer-format instruction appended to prompts (None: the mode's default, "
                                        "or none when the environment's template has its own)."})
    max_prompt_tokens: int | None = field(
        default=None, metadata={"help": "Token budget of a step's prompt: a longer prompt drops its oldest history "
                                        "pairs, then shortens the observation in the middle (metrics prompt/*); "
                                        "the task, admissible actions and format instruction are never cut. "
                                        "None: the model's context length minus max_completion_length."})

    # Advantages
    estimator: str = field(default="hgpo", metadata={"help": "Advantage estimator: grpo, gigpo, hgpo, progpo or "
                                                             "a name added with register_estimator."})
    gamma: float = field(default=0.95, metadata={"help": "Discount of the step returns."})
    hierarchy_depth: int | None = field(
        default=None, metadata={"help": "K: deepest HGPO level (and ProGPO depth); None means history_length."})
    alpha: float = field(default=1.0, metadata={"help": "HGPO level weights (k+2)^alpha."})
    weighting: str = field(default="power", metadata={"help": "HGPO weighting: 'power' or 'inverse_mse'."})
    base_group: bool = field(default=False, metadata={"help": "HGPO: add the episode (GRPO) advantage as an item."})
    drop_zero_items: bool = field(
        default=False, metadata={"help": "HGPO: drop every item equal to 0 (all-equal groups, members at their "
                                         "group's mean), as released; default: keep them."})
    omega: float = field(default=1.0, metadata={"help": "GiGPO weight of the step (anchor-state) term."})
    similarity_threshold: float | None = field(
        default=None, metadata={"help": "GiGPO: anchor groups of similar observation text: a step joins the first "
                                        "cluster of its task group whose first member has difflib ratio >= this "
                                        "with it (released algorithm.gigpo.enable_similarity, similarity_thresh "
                                        "0.95); 1.0: exact text; None: off, as released. HGPO (ours, not in the "
                                        "paper): its levels compare these clusters."})
    episode_stats: str = field(
        default="trajectories", metadata={"help": "Episode term of GRPO/GiGPO and HGPO's base item: one score per "
                                                  "'trajectories', or per step row over all rows of the task group "
                                                  "('steps', as released)."})
    std_ddof: int = field(
        default=0, metadata={"help": "ddof of mean_std_norm's std in the terms the release computes with torch.std "
                                     "(GRPO's, both GiGPO terms, HGPO's base item): 0 (population) or 1 (released). "
                                     "HGPO's levels always use 0, as released."})
    advantage_norm: str = field(
        default="mean_std_norm", metadata={"help": "Within-group normalisation: 'mean_std_norm' or 'mean_norm'."})
    progpo_lambda: float = field(default=1.0, metadata={"help": "ProGPO weight of the transition credit."})

    # Diagnostics
    diagnostics_every: int = field(
        default=0, metadata={"help": "Every this many iterations, log each estimator's bias and spread against "
                                     "whole-history oracle groups (diag/*; hgpo_trl.diagnostics); 0: never."})

    trajectory_dump_every: int = field(
        default=0, metadata={"help": "Every this many iterations, and at every evaluation, write each step (task, "
                                     "prompt, output, action, reward, return, advantage, HGPO groups and level "
                                     "weights) to output_dir/trajectories/*.jsonl (python -m "
                                     "hgpo_trl.evaluation.trajectories reads them), and at the end draw the run's newest in "
                                     "output_dir/trajectories.html (hgpo-view); 0: never."})

    # Evaluation
    eval_temperature: float = field(
        default=0.4, metadata={"help": "Sampling temperature of evaluate(); 0 means greedy."})
    eval_max_tasks: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many tasks of eval_dataset."})
    early_stop_success: float | None = field(
        default=None, metadata={"help": "Stop the run once validation success has been at or above this value for "
                                        "early_stop_patience evaluations in a row (the summary says so); None: "
                                        "train all train_iterations. Needs evaluations during training."})
    early_stop_patience: int = field(
        default=2, metadata={"help": "Consecutive evaluations at or above early_stop_success that stop the run."})

    logging_steps: float = field(
        default=1, metadata={"help": "Log every this many optimizer steps (TRL's default is 10): with 1, every "
                                     "iteration logs its metrics and prints its [iter] line."})
    console_metrics: bool = field(
        default=False, metadata={"help": "Also print every log's full metrics dict to the console, as TRL does "
                                         "(default: one [iter] line per iteration and one [eval] line per "
                                         "evaluation; the full dicts always go to report_to and "
                                         "trainer_state.json)."})

    accelerate_config: str | None = field(
        default=None, metadata={"help": "The accelerate config file this run is launched with (accelerate launch "
                                        "--config_file FILE): what --rehearse rehearses (its processes, machines, "
                                        "ZeRO stage, offloads). The paper configs name theirs; training itself "
                                        "follows the launcher."})

    # Reporting: TensorBoard by default (a dependency), unlike TrainingArguments' "none". The annotation is
    # TrainingArguments' own: HfArgumentParser reads a `None | str | list[str]` union only in this order.
    report_to: None | str | list[str] = field(  # noqa: RUF036
        default="tensorboard", metadata={"help": "Where metrics go: 'tensorboard' (default; logs under "
                                                 "output_dir/runs), 'wandb', 'trackio', a list of them, or 'none'."})


HELP_SECTIONS = {"env_name": "environment", "train_iterations": "iterations, step batches, cadence",
                 "history_length": "prompts and actions", "estimator": "advantages",
                 "diagnostics_every": "diagnostics and trajectory dumps", "eval_temperature": "evaluation",
                 "logging_steps": "console and reporting"}
"""The first field of each topic of HGPOFields' fields (in declaration order), for `--help`."""


def help_section(name: str) -> str:
    """The topic of HGPOConfig's own field `name`: that of the nearest section start declared before it."""
    section = "environment"
    for declared in vars(HGPOFields)["__annotations__"]:
        section = HELP_SECTIONS.get(declared, section)
        if declared == name:
            return section
    raise KeyError(f"{name} is not a field declared by HGPOConfig")


ESTIMATOR_FIELDS = {
    "gamma": "gamma", "hierarchy_depth": "depth", "alpha": "alpha", "advantage_norm": "norm",
    "weighting": "weighting", "base_group": "base_group", "drop_zero_items": "drop_zero_items", "omega": "omega",
    "episode_stats": "episode_stats", "std_ddof": "std_ddof", "invalid_penalty": "invalid_penalty",
    "progpo_lambda": "lam", "similarity_threshold": "similarity_threshold",
}
"""HGPOConfig's advantage fields and the estimator option each becomes."""
