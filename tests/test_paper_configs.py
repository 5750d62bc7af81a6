"""The paper configs run the released algorithm (issue 17): every value the released verl-agent scripts pass, and
every default of verl's ppo_trainer.yaml that changes training, held here as the released flag strings and
mapped to our fields, checked against each of configs/{alfworld,webshop}/*.yaml."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from hgpo_trl.config_checks import unread_estimator_fields

ROOT = Path(__file__).resolve().parents[1]

# recipe/hgpo/run_qwen2.5_{size}_{env}_train.sh (verl-agent's HGPO recipe), verbatim.
SCRIPTS = {
    ("alfworld", "1.5b"): """
        actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct  algorithm.hgpo.mode=mean_std_norm
        actor_rollout_ref.actor.ppo_mini_batch_size=256  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
        trainer.n_gpus_per_node=2  trainer.save_freq=40  data.val_batch_size=128  env.max_steps=50
        actor_rollout_ref.actor.optim.lr=1e-6  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16""",
    ("alfworld", "7b"): """
        actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct  algorithm.hgpo.mode=mean_std_norm
        actor_rollout_ref.actor.ppo_mini_batch_size=256  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
        trainer.n_gpus_per_node=4  trainer.save_freq=40  data.val_batch_size=128  env.max_steps=50
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8""",
    ("webshop", "1.5b"): """
        actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct  algorithm.hgpo.mode=mean_norm
        actor_rollout_ref.actor.ppo_mini_batch_size=64  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
        trainer.n_gpus_per_node=2  trainer.save_freq=40  val_data_size=256  env.max_steps=30
        actor_rollout_ref.actor.optim.lr=1e-6  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4""",
    ("webshop", "7b"): """
        actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct  algorithm.hgpo.mode=mean_norm
        actor_rollout_ref.actor.ppo_mini_batch_size=64  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
        trainer.n_gpus_per_node=4  trainer.save_freq=80  trainer.max_actor_ckpt_to_keep=1  val_data_size=256
        env.max_steps=30  actor_rollout_ref.actor.optim.lr=1e-6  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4""",
}
# Passed by all four scripts (the 7B ALFWorld one omits optim.lr: the default, 1e-6).
COMMON = """
    data.train_batch_size=16  env.rollout.n=8  data.max_prompt_length=4096  data.max_response_length=512
    actor_rollout_ref.actor.use_kl_loss=True  actor_rollout_ref.actor.kl_loss_coef=0.01
    actor_rollout_ref.actor.kl_loss_type=low_var_kl  actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.rollout.val_kwargs.temperature=0.4  actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.actor.use_invalid_action_penalty=True  actor_rollout_ref.actor.invalid_action_penalty_coef=0.1
    algorithm.gamma=0.95  algorithm.hgpo.weight_type=length  algorithm.hgpo.length_weight_alpha=1.0
    algorithm.hgpo.base_group=False  trainer.test_freq=5  trainer.total_epochs=160  trainer.val_before_train=False
    env.seed=0"""
# verl/trainer/config/ppo_trainer.yaml defaults the scripts leave alone, and the recipe's fixed choices.
DEFAULTS = """
    actor_rollout_ref.actor.clip_ratio=0.2  actor_rollout_ref.actor.clip_ratio_c=3.0
    actor_rollout_ref.actor.entropy_coeff=0.001  actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.ppo_epochs=1  actor_rollout_ref.actor.shuffle=False  actor_rollout_ref.actor.grad_clip=1.0
    actor_rollout_ref.actor.optim.weight_decay=0.01  actor_rollout_ref.actor.optim.warmup_style=constant
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.0  actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.actor.optim.lr=1e-6  compute_mean_std_cross_steps=True  adjust_batch.mode=copy
    algorithm.gigpo.mode=mean_norm  trainer.balance_batch=True  algorithm.gigpo.enable_similarity=False
    algorithm.gigpo.similarity_thresh=0.95"""

# Released flag -> (our field, the value it means). `None` as a field: checked by the function named instead.
MAPPING = {
    "actor_rollout_ref.model.path": lambda v: {"model_name_or_path": v},
    "algorithm.hgpo.mode": lambda v: {"hgpo_norm": v},
    "algorithm.gigpo.mode": lambda v: {"gigpo_norm": v},
    # Similarity-based anchor groups: off in every script (similarity_threshold None); the threshold counts only when on.
    "algorithm.gigpo.enable_similarity": lambda v: {"similarity_threshold": {"False": None}[v]},
    "algorithm.gigpo.similarity_thresh": lambda v: {},
    "actor_rollout_ref.actor.ppo_mini_batch_size": lambda v: {"mini_batch_size": int(v)},
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": lambda v: {"per_device_train_batch_size": int(v)},
    "trainer.save_freq": lambda v: {"save_every_iterations": int(v)},
    "trainer.max_actor_ckpt_to_keep": lambda v: {"save_total_limit": int(v)},
    "data.val_batch_size": lambda v: {"num_eval_tasks": int(v)},
    "val_data_size": lambda v: {"num_eval_tasks": int(v)},  # WebShop's test parquet: 2 x data.val_batch_size rows
    "env.max_steps": lambda v: {"max_env_steps": int(v)},
    "actor_rollout_ref.actor.optim.lr": lambda v: {"learning_rate": float(v)},
    "env.rollout.n": lambda v: {"num_generations": int(v)},
    "data.max_prompt_length": lambda v: {"max_prompt_tokens": int(v)},
    "data.max_response_length": lambda v: {"max_completion_length": int(v)},
    "actor_rollout_ref.actor.use_kl_loss": lambda v: {},  # with kl_loss_coef: beta
    "actor_rollout_ref.actor.kl_loss_coef": lambda v: {"beta": float(v)},
    "actor_rollout_ref.actor.kl_loss_type": lambda v: {},  # TRL's k3 is low_var_kl (not clamped: a comment says so)
    "actor_rollout_ref.model.enable_gradient_checkpointing": lambda v: {"gradient_checkpointing": v == "True"},
    "actor_rollout_ref.rollout.val_kwargs.temperature": lambda v: {"eval_temperature": float(v)},
    "actor_rollout_ref.rollout.val_kwargs.do_sample": lambda v: {},  # eval_temperature > 0 samples
    "actor_rollout_ref.actor.use_invalid_action_penalty": lambda v: {},
    "actor_rollout_ref.actor.invalid_action_penalty_coef": lambda v: {"invalid_penalty": float(v)},
    "algorithm.gamma": lambda v: {"gamma": float(v)},
    "algorithm.hgpo.weight_type": lambda v: {"weighting": "power"},  # length: (k+2)^alpha
    "algorithm.hgpo.length_weight_alpha": lambda v: {"alpha": float(v)},
    "algorithm.hgpo.base_group": lambda v: {"base_group": v == "True"},
    "trainer.test_freq": lambda v: {"eval_every_iterations": int(v)},
    "trainer.total_epochs": lambda v: {"train_iterations": int(v)},
    "trainer.val_before_train": lambda v: {"eval_before_training": v == "True"},
    "env.seed": lambda v: {"seed": int(v)},
    "actor_rollout_ref.actor.clip_ratio": lambda v: {"epsilon": float(v)},
    "actor_rollout_ref.actor.clip_ratio_c": lambda v: {"delta": float(v)},
    "actor_rollout_ref.actor.entropy_coeff": lambda v: {"entropy_coef": float(v)},
    # token-mean per micro-batch, divided by the fixed accumulation count: TRL's bnpo.
    "actor_rollout_ref.actor.loss_agg_mode": lambda v: {"loss_type": {"token-mean": "bnpo"}[v]},
    "actor_rollout_ref.actor.ppo_epochs": lambda v: {"num_iterations": int(v)},
    "actor_rollout_ref.actor.shuffle": lambda v: {"shuffle_steps": v == "True"},
    "actor_rollout_ref.actor.grad_clip": lambda v: {"max_grad_norm": float(v)},
    "actor_rollout_ref.actor.optim.weight_decay": lambda v: {"weight_decay": float(v)},
    "actor_rollout_ref.actor.optim.warmup_style": lambda v: {"lr_scheduler_type": v},
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": lambda v: {"warmup_steps": 0},
    "actor_rollout_ref.rollout.temperature": lambda v: {"temperature": float(v)},
    "compute_mean_std_cross_steps": lambda v: {"episode_stats": "steps" if v == "True" else "trajectories"},
    "adjust_batch.mode": lambda v: {"fill_last_micro_batch": {"copy": "duplicate"}[v]},
    # _balance_batch splits with get_seqlen_balanced_partitions(..., equal_size=True): Karmarkar-Karp.
    "trainer.balance_batch": lambda v: {"balance_steps": v == "True", "balance_partition": "karmarkar_karp"},
    # adjust_batch's divisor, lcm(log-prob micro-batches, actor micro-batch) x GPUs (checked below).
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": lambda v: {},
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": lambda v: {},
    # Per process: data.train_batch_size / trainer.n_gpus_per_node (checked below).
    "data.train_batch_size": lambda v: {},
    "trainer.n_gpus_per_node": lambda v: {},
}
METHODS = {"grpo": ("grpo", 2), "gigpo_k2": ("gigpo", 2), "gigpo_k4": ("gigpo", 4), "hgpo_k2": ("hgpo", 2),
           "hgpo_k4": ("hgpo", 4)}
PAPER = [(env, size, method) for env, size in SCRIPTS for method in METHODS]


def flags(text: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in text.split())


def expected(env: str, size: str, method: str) -> dict:
    released = {**flags(DEFAULTS), **flags(COMMON), **flags(SCRIPTS[env, size])}
    fields = {}
    for flag, value in released.items():
        fields.update(MAPPING[flag](value))
    # recipe/hgpo/config/hgpo_trainer.yaml: trainer.val_out=False, ALFWorld's eval_in_distribution games; WebShop
    # validates on goals 0-499 (env_package/webshop), WebShop's test goals.
    fields["eval_split"] = {"alfworld": "valid_seen", "webshop": "test"}[env]
    estimator, k = METHODS[method]
    fields.update(estimator=estimator, history_length=k, step_batching="all_steps", std_ddof=1)
    # Each estimator reads its own mode: GRPO's norm_adv_by_std_in_grpo=True (default) is mean_std_norm.
    hgpo_norm, gigpo_norm = fields.pop("hgpo_norm"), fields.pop("gigpo_norm")
    fields["advantage_norm"] = {"hgpo": hgpo_norm, "gigpo": gigpo_norm, "grpo": "mean_std_norm"}[estimator]
    # TRL extras the release has not: no vLLM / trainer importance ratio, no ratio on the KL term.
    fields.update(vllm_importance_sampling_correction=False, use_bias_correction_kl=False)
    # A config sets only what its estimator reads (GRPO no gamma, GiGPO no HGPO weights): train.py warns otherwise.
    for field in unread_estimator_fields(estimator, list(fields)):
        fields.pop(field)
    if estimator == "hgpo":
        fields["drop_zero_items"] = True  # core_hgpo keeps only items != 0
    # What the model sees: env_package/{alfworld,webshop}/projection.py reads every output, a penalised one's
    # action is still carried out.
    fields["invalid_action"] = "execute"
    # agent_system/multi_turn_rollout: each turn generates every live episode's prompt in one call, then steps
    # every environment (a continuous rollout plays the same records, its samples drawn per request).
    fields["rollout_mode"] = "lockstep"
    # adjust_batch fills the batch to a multiple of lcm(rollout and ref log-prob micro, actor micro) x GPUs;
    # fill_multiple is set where that is not per_device_train_batch_size x processes, its default.
    gpus = int(released["trainer.n_gpus_per_node"])
    micro = int(released["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"])
    divisor = math.lcm(*(gpus * int(released[f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu"])
                         for role in ("rollout", "ref")), gpus * micro)
    if divisor != gpus * micro:
        fields["fill_multiple"] = divisor
    # ALFWorld's observations are the game's text as written (the banner too); WebShop's after an invalid action
    # the unchanged page (web_agent_text_env.py: no notice).
    fields["env_kwargs"] = {"alfworld": {"raw_observations": True}, "webshop": {"invalid_notice": False}}[env]
    return fields


def load(env: str, size: str, method: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / env / f"{method}_qwen2.5-{size}.yaml").read_text())


def test_every_paper_config_is_a_released_cell_and_every_cell_has_one():
    shipped = {(p.parent.name, p.stem.split("_qwen2.5-")[1], p.stem.split("_qwen2.5-")[0])
               for env in ("alfworld", "webshop") for p in (ROOT / "configs" / env).glob("*_qwen2.5-*.yaml")}
    assert shipped == set(PAPER)


@pytest.mark.parametrize(("env", "size", "method"), PAPER, ids=lambda x: str(x))
def test_paper_configs_hold_the_released_values(env, size, method):
    config = load(env, size, method)
    wrong = {field: (config.get(field), value) for field, value in expected(env, size, method).items()
             if config.get(field) != value}
    assert not wrong, f"configs/{env}/{method}_qwen2.5-{size}.yaml differs from the release (ours, released): {wrong}"
    # K is the memory length: HGPO's depth follows it (no separate hierarchy_depth).
    assert "hierarchy_depth" not in config
    # Sized as released: the accelerate config its header names runs n_gpus_per_node processes, each playing
    # train_batch_size / n_gpus_per_node tasks, with every micro-batch count of a mini-batch a whole number.
    released = {**flags(COMMON), **flags(SCRIPTS[env, size])}
    gpus = int(released["trainer.n_gpus_per_node"])
    header = next(line for line in (ROOT / "configs" / env / f"{method}_qwen2.5-{size}.yaml").read_text().splitlines()
                  if "accelerate launch" in line)
    accelerate = yaml.safe_load((ROOT / header.split("--config_file ")[1].split()[0]).read_text())
    assert accelerate["num_processes"] == gpus
    assert config["tasks_per_device"] * gpus == int(released["data.train_batch_size"])
    assert config["mini_batch_size"] % (config["per_device_train_batch_size"] * gpus) == 0
    # Full-precision master weights under bf16 compute, as verl's FSDP mixed precision keeps them.
    assert config["dtype"] == "float32" and config["bf16"] is True


def test_trls_delta_bounds_the_loss_as_verls_dual_clip(tmp_path, tiny_model, tiny_tokenizer):
    """clip_ratio_c=3.0 -> delta=3.0: TRL caps the ratio at delta before its clipped minimum; verl's dual clip takes
    min(-c A, the clipped loss) where A < 0. The same per-token loss for ratios from 0.1 to 5 and both signs."""
    from tests.test_trainer import make_config, make_trainer

    args = make_config(tmp_path, loss_type="bnpo", epsilon=0.2, delta=3.0, beta=0.0, entropy_coef=0.0)
    trainer = make_trainer(tiny_model, tiny_tokenizer, args)
    trainer.current_gradient_accumulation_steps = 1
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, tiny_model.config.vocab_size, (6, 5), generator=generator)
    completion = torch.randint(3, tiny_model.config.vocab_size, (6, 8), generator=generator)
    ones = torch.ones_like
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            tiny_model, torch.cat([prompt, completion], 1), torch.cat([ones(prompt), ones(completion)], 1), 8)
    ratio = torch.logspace(math.log10(0.1), math.log10(5.0), 48).reshape(6, 8)
    advantages = torch.tensor([1.5, -1.5, 0.7, -0.7, 2.0, -2.0])
    inputs = {"prompt_ids": prompt, "prompt_mask": ones(prompt), "completion_ids": completion,
              "completion_mask": ones(completion), "advantages": advantages,
              "old_per_token_logps": logps - torch.log(ratio), "num_items_in_batch": torch.tensor(48.0)}
    trl = trainer._compute_loss(tiny_model, inputs)
    a = advantages[:, None]
    clipped = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
    verl = torch.where(a < 0, torch.minimum(-a * 3.0, clipped), clipped).mean()
    assert torch.allclose(trl, verl, atol=1e-5), (trl, verl)
