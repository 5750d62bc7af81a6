"""HGPOTrainer on the tiny offline model and the keydoor environment (one process, CPU)."""

import inspect
import re
import time

import numpy as np
import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from hgpo_trl.advantages import ESTIMATORS, register_estimator
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_tasks
from hgpo_trl.envs.keydoor import KeyDoorEnv
from hgpo_trl.models.tiny import build_tiny_model
from hgpo_trl.rollout.sampler import TaskSampler
from hgpo_trl.trainer import HGPOTrainer
from hgpo_trl.training.loss_inputs import LOSS_INPUT_KEYS


def make_config(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, num_generations=4,
                    tasks_per_device=2, max_completion_length=4, max_env_steps=5, action_mode="plain",
                    invalid_action="end_episode", learning_rate=1e-2, train_iterations=2, logging_steps=1,
                    report_to="none", use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    settings.update(overrides)
    return HGPOConfig(**settings)


def make_trainer(model, tokenizer, args, **kwargs):
    return HGPOTrainer(model=model, args=args, processing_class=tokenizer,
                       train_dataset=make_tasks("keydoor", "train", num_tasks=8),
                       eval_dataset=make_tasks("keydoor", "valid", num_tasks=2), **kwargs)


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def changed(model, before):
    return [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]


EXPECTED_METRICS = {
    "env/success_rate", "env/episode_reward", "env/episode_length", "env/invalid_rate", "env/faults",
    "adv/mean", "adv/std",
    "steps/collected", "steps/kept", "steps/kept_fraction", "steps/padded_fraction", "time/generation",
    "time/env", "time/rollout", "time/advantages", "time/training", "throughput/env_steps_per_second",
    "hgpo/level0_with_peers", "hgpo/level1_with_peers", "hgpo/level2_with_peers", "loss", "entropy",
}


def test_one_iteration_changes_parameters_and_logs_every_metric(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path))
    before = snapshot(tiny_model)
    trainer.train()
    assert changed(tiny_model, before)
    logs = [h for h in trainer.state.log_history if "env/success_rate" in h]
    assert len(logs) == 2 and trainer.state.global_step == 2
    assert EXPECTED_METRICS <= set(logs[0]), EXPECTED_METRICS - set(logs[0])
    assert logs[0]["steps/kept"] <= 16 and 0 < logs[0]["steps/kept_fraction"] <= 1
    assert all(0 <= h["env/invalid_rate"] <= 1 for h in logs)


def test_zero_advantages_give_zero_policy_gradient(tmp_path, tiny_model, tiny_tokenizer):
    register_estimator("test_zero", lambda batch: np.zeros(len(batch)))
    try:
        trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, estimator="test_zero"))
        before = snapshot(tiny_model)
        trainer.train()
    finally:
        ESTIMATORS.pop("test_zero")
    assert not changed(tiny_model, before)  # Adam with zero gradients and no weight decay moves nothing
    assert trainer.state.log_history[0]["grad_norm"] == 0.0


def test_invalid_outputs_are_counted(tmp_path, tiny_model, tiny_tokenizer):
    # A random tiny model in tags mode never writes well-formed tags: every step is invalid and ends its episode.
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, action_mode="tags", train_iterations=1))
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["env/invalid_rate"] == 1.0 and log["env/episode_length"] == 1.0
    assert log["steps/collected"] == 8 and log["steps/padded_fraction"] == 0.5


@pytest.mark.parametrize("options", [
    {"num_iterations": 2},
    {"steps_per_generation": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
    {"gradient_checkpointing": True},
    {"estimator": "gigpo"}, {"estimator": "grpo"}, {"estimator": "progpo"},
    {"estimator": "hgpo", "weighting": "inverse_mse", "base_group": True},
    {"loss_type": "grpo"},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_compatible_settings_train(tmp_path, tiny_model, tiny_tokenizer, options):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, **options))
    before = snapshot(tiny_model)
    trainer.train()
    assert changed(tiny_model, before)
    assert trainer.state.global_step == trainer.args.max_steps


def test_cpu_runs_default_to_float32_and_an_explicit_bf16_is_kept(tmp_path, tiny_model, tiny_tokenizer):
    # TRL's default (bf16 on) would make a CPU run autocast to bf16: slower, with coarser log-probabilities.
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path))
    assert trainer.args.bf16 is False and trainer.accelerator.mixed_precision == "no"
    assert make_config(tmp_path, bf16=True).bf16 is True


def test_train_iterations_set_optimizer_steps(tmp_path):
    args = make_config(tmp_path, train_iterations=3, num_iterations=2, steps_per_generation=2,
                       per_device_train_batch_size=8)
    assert args.max_steps == 3 * 2 * 2 // args.gradient_accumulation_steps


def test_lora_adapter_trains_and_base_stays(tmp_path, tiny_model, tiny_tokenizer):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, beta=0.05), peft_config=lora)
    model = trainer.model
    before = snapshot(model)
    trainer.train()
    moved = changed(model, before)
    assert moved and all("lora" in name for name in moved)
    assert any("kl" == k for h in trainer.state.log_history for k in h)


def test_kl_penalty_with_a_model_built_in_memory(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, beta=0.1))
    assert trainer.ref_model is not None
    reference = snapshot(trainer.ref_model)
    initial = snapshot(tiny_model)
    assert all(torch.equal(reference[k], initial[k]) for k in initial)  # the reference is the initial policy
    trainer.train()
    kls = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert kls and all(np.isfinite(kls))


def test_a_resumed_run_keeps_the_reference_its_start_saved(tmp_path, tiny_model, tiny_tokenizer):
    make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, beta=0.1))
    saved = snapshot(AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "reference_model"))
    other = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=1)
    resumed = make_trainer(other, tiny_tokenizer, make_config(tmp_path, beta=0.1, resume_from_checkpoint="any"))
    on_disk = snapshot(AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "reference_model"))
    assert all(torch.equal(saved[k], on_disk[k]) for k in saved)  # not overwritten by the model passed to resume
    assert all(torch.equal(saved[k], v) for k, v in snapshot(resumed.ref_model).items())
    assert (tmp_path / "out" / "reference_model" / "tokenizer.json").is_file()  # a complete model folder


def test_resuming_without_the_saved_reference_names_it(tmp_path, tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"reference_model, is missing"):
        make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, beta=0.1, resume_from_checkpoint="any"))


def test_model_from_a_path(tmp_path, tiny_model_path, tiny_tokenizer):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, make_config(tmp_path, beta=0.1, train_iterations=1))
    trainer.train()
    assert trainer.state.global_step == 1


def test_evaluate_plays_each_validation_task_once(tmp_path, tiny_model, tiny_tokenizer, caplog):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, eval_temperature=0.0))
    metrics = trainer.evaluate()
    assert metrics["eval_tasks"] == 2.0 and 0.0 <= metrics["eval_success_rate"] <= 1.0
    assert any("eval_success_rate" in h for h in trainer.state.log_history)
    # Greedy evaluation sets no sampling flags (TRL's top_k 0 drew a transformers warning every evaluation).
    assert "generation flags are not valid" not in caplog.text


def test_log_completions_rows_line_up(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, log_completions=True,
                                                                   train_iterations=1))
    trainer.train()
    logs = trainer._logs
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["advantages"]) == len(
        logs["rewards"]["env_reward"]) > 0
    assert (tmp_path / "out" / "completions").is_dir()


def test_task_sampler_gives_each_process_distinct_tasks_repeated_per_micro_step():
    sampler = TaskSampler(list(range(10)), tasks_per_iteration=4, repeat=3, seed=1)
    indices = list(sampler)
    assert len(indices) == len(sampler) == 3 * 4 * 3  # 3 iterations cover 10 tasks
    first = indices[:12]
    assert first[:4] == first[4:8] == first[8:12] and len(set(first[:4])) == 4
    # Accelerate gives process p the p-th slice of 2 rows of each 4: both processes, disjoint tasks.
    rank0, rank1 = first[:2], first[2:4]
    assert not set(rank0) & set(rank1)
    covered = {i for start in range(0, 36, 12) for i in indices[start:start + 4]}
    assert covered == set(range(10))


def test_bad_config_values_name_the_field(tmp_path):
    for field, value, message in [("estimator", "ppo", "HGPOConfig.estimator must be one of"),
                                  ("action_mode", "json", "HGPOConfig.action_mode must be one of"),
                                  ("history_length", -1, "HGPOConfig.history_length must be"),
                                  ("gamma", 2.0, r"HGPOConfig.gamma must be in \[0, 1\]"),
                                  ("invalid_action", "retry", "HGPOConfig.invalid_action must be one of"),
                                  ("num_generations", 1, "HGPOConfig.num_generations must be")]:
        with pytest.raises(ValueError, match=message):
            make_config(tmp_path, **{field: value})
    with pytest.warns(UserWarning, match=r"hierarchy_depth \(4\) > history_length \(2\)"):
        make_config(tmp_path, hierarchy_depth=4)


def test_the_keys_grpo_loss_reads_are_the_keys_we_provide():
    """Fails loudly when a TRL upgrade changes what `_compute_loss` reads from the generation dict."""
    source = inspect.getsource(GRPOTrainer._compute_loss)
    read = set(re.findall(r'inputs\["(\w+)"\]', source)) | set(re.findall(r'inputs\.get\("(\w+)"', source))
    multimodal = {"pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                  "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
                  "tool_mask"}
    assert read - multimodal == set(LOSS_INPUT_KEYS), (
        f"TRL's loss now reads {sorted(read - multimodal)}; HGPOTrainer provides {sorted(LOSS_INPUT_KEYS)}")


class RaisingEnv:
    """Keydoor whose second step raises for tasks marked `fault`: an environment that breaks mid-episode."""

    def __init__(self):
        from hgpo_trl.envs.keydoor import KeyDoorEnv

        self.env = KeyDoorEnv()
        self.render_prompt = self.env.render_prompt
        self.max_steps = self.env.max_steps

    def reset(self, task):
        self.fault, self.steps = task.get("fault", False), 0
        return self.env.reset(task)

    def step(self, action):
        self.steps += 1
        if self.fault and self.steps == 2:
            raise RuntimeError("injected fault")
        return self.env.step(action)

    def close(self):
        self.env.close()


def test_environment_faults_fail_their_episodes_and_training_goes_on(tmp_path, tiny_model, tiny_tokenizer):
    rows = [dict(row, fault=i % 2 == 0) for i, row in enumerate(make_tasks("keydoor", "train", num_tasks=8))]
    from datasets import Dataset

    args = make_config(tmp_path, invalid_action="noop")
    trainer = HGPOTrainer(model=tiny_model, args=args, processing_class=tiny_tokenizer,
                          train_dataset=Dataset.from_list(rows), env_factory=RaisingEnv)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "env/faults" in h]
    assert trainer.state.global_step == 2 and sum(h["env/faults"] for h in logs) > 0


class SlowEnv(KeyDoorEnv):
    """Keydoor that takes 50 ms a step: a rollout long next to a tiny model's training step."""

    def step(self, action):
        time.sleep(0.05)
        return super().step(action)


def test_training_time_leaves_out_the_rollout(tmp_path, tiny_model, tiny_tokenizer):
    # TRL builds the batch (here: the whole rollout) inside training_step; time/training must not count it.
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path), env_factory=SlowEnv)
    trainer.train()
    second = [h for h in trainer.state.log_history if "time/training" in h][1]
    assert second["time/env"] > 0.5  # at least 16 episodes x 1 step x 50 ms
    assert 0 < second["time/training"] < 0.5 * second["time/env"]


def test_webshop_trains_and_logs_its_score(tmp_path):
    from hgpo_trl.envs import make_env
    from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer
    from hgpo_trl.models.warmstart import environment_corpus

    tasks = make_tasks("webshop", "train", num_tasks=2)
    tokenizer = build_tiny_tokenizer(environment_corpus(make_env("webshop"), list(tasks), episodes=4, max_steps=3))
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2)
    args = make_config(tmp_path, env_name="webshop", tasks_per_device=1, num_generations=2,
                       per_device_train_batch_size=4, max_env_steps=3, train_iterations=1)
    trainer = HGPOTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=tasks,
                          eval_dataset=tasks.select(range(1)))
    trainer.train()
    log = next(h for h in trainer.state.log_history if "env/success_rate" in h)
    assert 0.0 <= log["env/score"] <= 1.0
    assert "eval_score" in trainer.evaluate()


def test_diagnostics_are_logged_every_n_iterations(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, diagnostics_every=2, train_iterations=3))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "env/success_rate" in h]
    assert ["diag/hgpo_bias" in h for h in logs] == [True, False, True]
    for name in ("grpo", "gigpo", "hgpo"):
        assert np.isfinite(logs[0][f"diag/{name}_bias"]) and logs[0][f"diag/{name}_spread"] >= 0
    assert logs[0]["diag/oracle_steps"] >= 1  # the G rollouts of a task share their first observation


def test_tensorboard_logs_land_in_output_dir_even_when_evaluating_first(tmp_path, tiny_model, tiny_tokenizer,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, report_to="tensorboard",
                                                                   train_iterations=1))
    trainer.evaluate()
    trainer.train()
    assert list((tmp_path / "out" / "runs").rglob("events.out.tfevents.*"))
    assert not (tmp_path / "runs").exists()


def test_a_broken_environment_stops_the_run_after_a_checkpoint(tmp_path, tiny_model, tiny_tokenizer):
    from datasets import Dataset

    rows = [dict(row, fault=True) for row in make_tasks("keydoor", "train", num_tasks=8)]
    args = make_config(tmp_path, invalid_action="noop", train_iterations=5, max_faulty_iterations=2)
    trainer = HGPOTrainer(model=tiny_model, args=args, processing_class=tiny_tokenizer,
                          train_dataset=Dataset.from_list(rows), env_factory=RaisingEnv)
    with pytest.raises(RuntimeError, match=r"more than half the episodes failed in 2 iterations in a row .*"
                                           r"injected fault.*resume with --resume_from_checkpoint"):
        trainer.train()
    checkpoints = list((tmp_path / "out").glob("checkpoint-*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "model.safetensors").exists()


def test_a_non_finite_loss_stops_before_the_update(tmp_path, tiny_model, tiny_tokenizer):
    # Finite in float64, infinite once the loss casts it to float32: a real overflow on the real loss path.
    register_estimator("test_huge", lambda batch: np.where(np.arange(len(batch)) % 2, 1e300, -1e300))
    try:
        trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, estimator="test_huge"))
        before = snapshot(tiny_model)
        with pytest.raises(FloatingPointError, match=r"non-finite loss at iteration 1 \(1-based; optimizer step 1\).*"
                                                     r"parameters were not updated"):
            trainer.train()
    finally:
        ESTIMATORS.pop("test_huge")
    assert not changed(tiny_model, before)


def test_checkpoints_appear_only_when_complete(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    from transformers.trainer_utils import get_last_checkpoint

    args = make_config(tmp_path, train_iterations=3, save_strategy="steps", save_steps=1, save_total_limit=2)
    trainer = make_trainer(tiny_model, tiny_tokenizer, args)
    original = HGPOTrainer._save_rng_state

    def killed_during_the_third_save(self, output_dir):
        if self.state.global_step == 3:
            raise KeyboardInterrupt("killed while saving")  # after the weights and optimizer were written
        original(self, output_dir)

    monkeypatch.setattr(HGPOTrainer, "_save_rng_state", killed_during_the_third_save)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert (out / "checkpoint-2" / "trainer_state.json").exists() and (out / "checkpoint-2" / "rng_state.pth").exists()
    assert (out / ".staging" / "checkpoint-3" / "model.safetensors").exists()  # the partial save, out of the way


def test_checkpoint_rotation_keeps_the_newest(tmp_path, tiny_model, tiny_tokenizer):
    args = make_config(tmp_path, train_iterations=3, save_strategy="steps", save_steps=1, save_total_limit=2)
    make_trainer(tiny_model, tiny_tokenizer, args).train()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert not list((out / ".staging").glob("checkpoint-*"))


@pytest.mark.slow
def test_worker_faults_in_training_fail_episodes_and_training_goes_on(tmp_path, tiny_model, tiny_tokenizer):
    """Environments in worker processes that raise, hang past env_step_timeout, or kill their worker, in reset
    and mid-episode: their episodes fail and are counted, workers are replaced, every iteration completes."""
    from datasets import Dataset

    from tests.test_pool import FaultyEnv

    faults = [("raise", 0), ("raise", 2), ("hang", 1), ("exit", 2), (None, 0), (None, 0)]
    rows = [dict(row, fault=fault, fault_step=step)
            for row, (fault, step) in zip(make_tasks("keydoor", "train", num_tasks=6), faults, strict=True)]
    args = make_config(tmp_path, invalid_action="noop", tasks_per_device=2, train_iterations=3, env_workers=2,
                       env_step_timeout=3.0, env_reset_timeout=30.0, max_faulty_iterations=0)
    trainer = HGPOTrainer(model=tiny_model, args=args, processing_class=tiny_tokenizer,
                          train_dataset=Dataset.from_list(rows), env_factory=FaultyEnv)
    try:
        trainer.train()
    finally:
        trainer.close_environments()
    logs = [h for h in trainer.state.log_history if "env/faults" in h]
    assert trainer.state.global_step == 3 and len(logs) == 3
    assert sum(h["env/faults"] for h in logs) >= 4  # every faulty task played fails its episodes


def test_prompts_are_fitted_to_the_model_context_by_default(tmp_path, tiny_tokenizer):
    from hgpo_trl.models.tiny import build_tiny_model
    from hgpo_trl.rollout.generation import encode_prompt

    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64)
    trainer = make_trainer(model, tiny_tokenizer, make_config(tmp_path, history_length=3, train_iterations=2))
    assert trainer.rollout_settings.max_prompt_tokens == 64 - 4
    trainer.train()
    logs = [h for h in trainer.state.log_history if "prompt/history_cut" in h]
    assert max(h["prompt/history_cut"] for h in logs) > 0  # a 64-token context cannot hold 3 history pairs
    rollout = trainer._play(list(make_tasks("keydoor", "train", num_tasks=2)), 2, 1.0)
    assert all(len(encode_prompt(trainer.processing_class, s.prompt, trainer.chat_template_kwargs)) <= 60
               or s.over_budget for s in rollout.steps)


def test_early_stop_counts_only_evaluations_during_training(tmp_path, tiny_model, tiny_tokenizer):
    # The evaluation before training (cli's, or eval_on_start) neither stops the run nor leaves a reason.
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(
        tmp_path, early_stop_success=0.5, early_stop_patience=1, eval_every_iterations=1, train_iterations=2))
    control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control,
                                                   {"eval_success_rate": 1.0})
    assert not control.should_training_stop and trainer.early_stop.reason is None
    trainer.train()  # the untrained tiny model scores 0: both iterations run
    assert trainer.completed_iterations == 2 and trainer.early_stop.reason is None
    trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, {"eval_success_rate": 1.0})
    assert trainer.early_stop.reason is None, "an evaluation after training does not count either"


def test_on_a_cpu_the_fused_head_scores_the_completion_positions_only_with_the_same_log_probs(tiny_model):
    """TRL scores every position without Triton; `completion_positions_only` scores the labelled ones (the
    completions), which is what the log-probabilities read: the same values, a fraction of the work."""
    import trl.trainer.utils as trl_utils

    from hgpo_trl.training.loss_inputs import completion_positions_only

    model = tiny_model
    trl_utils.add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs", "entropy"))
    input_ids = torch.randint(5, 40, (3, 12))
    labels = torch.full_like(input_ids, -100)
    labels[:, 9:] = input_ids[:, 9:]  # the last 3 positions are the completion
    scored, apply = [], trl_utils._ChunkedLogProbFunction.apply

    def counting(hidden, *rest):
        scored.append(hidden.shape[0])
        return apply(hidden, *rest)

    trl_utils._ChunkedLogProbFunction.apply = counting
    try:
        every = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
        with completion_positions_only():
            compact = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    finally:
        trl_utils._ChunkedLogProbFunction.apply = apply
    assert scored == [3 * 11, 3 * 3]  # every shifted position, then the labelled ones
    assert torch.allclose(every.log_probs, compact.log_probs, atol=1e-6)
    assert torch.allclose(every.entropy, compact.entropy, atol=1e-6)
    assert trl_utils._use_triton(torch.device("cpu")) is False  # put back
