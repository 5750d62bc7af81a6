"""step_batching="all_steps" (issue 17): every collected step is trained once per iteration, in mini-batches of a
global size with one optimizer step each, iterations driving the stop, the schedule and the cadence."""

import copy
import json

import numpy as np
import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from hgpo_trl.advantages import ESTIMATORS, register_estimator
from hgpo_trl.envs import make_tasks
from hgpo_trl.envs.keydoor import KeyDoorEnv
from hgpo_trl.training import loss_inputs as budgets
from hgpo_trl.training.step_batches import (
    importance_sampling_ratio,
    plan_micro_batches,
    select_budget,
    windows_for,
)
from tests.test_rollout import optimal_action, play, scripted
from tests.test_trainer import make_config, make_trainer, snapshot


def all_steps_config(tmp_path, **overrides):
    settings = dict(step_batching="all_steps", per_device_train_batch_size=4, mini_batch_size=8,
                    invalid_action="noop", train_iterations=2)
    settings.update(overrides)
    return make_config(tmp_path, **settings)


# ------------------------------------------------------------------ the plan, as pure functions
@pytest.mark.parametrize("num_steps", [0, 1, 7, 8, 9, 23])
def test_the_plan_holds_every_step_exactly_once_in_rollout_order(num_steps):
    plan = plan_micro_batches(num_steps, 4, "pad", False, np.random.default_rng(0))
    assert np.concatenate([np.zeros(0, dtype=int), *plan]).tolist() == list(range(num_steps))
    assert [len(m) for m in plan][:-1] == [4] * (len(plan) - 1) if plan else num_steps == 0


def test_duplicates_fill_the_last_micro_batch_with_distinct_copies():
    plan = plan_micro_batches(10, 4, "duplicate", False, np.random.default_rng(0))
    assert [len(m) for m in plan] == [4, 4, 4]
    rows = np.concatenate(plan)
    assert rows[:10].tolist() == list(range(10))
    copies = rows[10:]
    assert len(set(copies.tolist())) == 2 and set(copies.tolist()) <= set(range(10))
    assert [len(m) for m in plan_micro_batches(8, 4, "duplicate", False, np.random.default_rng(0))] == [4, 4]


def test_shuffled_plans_are_permutations():
    plan = plan_micro_batches(11, 4, "pad", True, np.random.default_rng(3))
    rows = np.concatenate(plan).tolist()
    assert sorted(rows) == list(range(11)) and rows != list(range(11))


@pytest.mark.parametrize(("busiest", "accumulation", "windows"), [(1, 8, 1), (8, 8, 1), (9, 8, 2), (25, 2, 13)])
def test_windows_cover_the_busiest_process_and_none_is_padding_alone(busiest, accumulation, windows):
    assert windows_for(busiest, accumulation) == windows
    # The busiest process's last real micro-batch falls in the last window.
    assert (windows - 1) * accumulation < busiest <= windows * accumulation


def test_importance_sampling_ratio_by_hand():
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    sampling = torch.tensor([[-1.5, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    # Per token exp(0.5) = 1.65 and exp(-1) = 0.37, truncated to [0.5, 1.5]; exactly 1 for the masked, unscored one.
    token = importance_sampling_ratio(old, sampling, mask, "token_truncate", 0.5, 1.5)
    assert torch.allclose(token, torch.tensor([[1.5, 0.5, 1.0]]))
    masked = importance_sampling_ratio(old, sampling, mask, "token_mask", 0.5, 1.5)
    assert torch.allclose(masked, torch.tensor([[0.0, 0.0, 1.0]]))
    sequence = importance_sampling_ratio(old, sampling, mask, "sequence_truncate", None, 2.0)
    assert torch.allclose(sequence, torch.tensor([[float(np.exp(-0.5))]]))
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        importance_sampling_ratio(old, sampling, mask, "tokens", None, None)


# ------------------------------------------------------------------ the config
def test_mini_batch_size_sets_the_accumulation_and_train_iterations_bound_max_steps(tmp_path):
    args = all_steps_config(tmp_path, mini_batch_size=16, per_device_train_batch_size=4)
    assert args.gradient_accumulation_steps == 4
    # 2 tasks x 4 rollouts x 5 steps = 40 rows at most: 10 micro-batches, 3 windows, per iteration.
    assert args.max_steps == 2 * 3
    assert args.save_strategy == "no"  # the Trainer's default (every 500 optimizer steps) is off


@pytest.mark.parametrize(("overrides", "message"), [
    ({"train_iterations": None}, "needs train_iterations"),
    ({"mini_batch_size": 6}, r"mini_batch_size \(6\) must be a multiple of per_device_train_batch_size \(4\)"),
    ({"gradient_accumulation_steps": 3}, r"gradient_accumulation_steps \(3\) disagrees with mini_batch_size"),
    ({"eval_strategy": "steps", "eval_steps": 2}, r"eval_strategy='steps' counts optimizer steps.*eval_every_iterations"),
    ({"save_strategy": "steps", "save_steps": 3}, "use save_every_iterations"),
    ({"step_batching": "every"}, "HGPOConfig.step_batching must be one of"),
    ({"fill_last_micro_batch": "copy"}, "HGPOConfig.fill_last_micro_batch must be one of"),
    ({"step_batching": "fixed_budget", "balance_steps": True, "mini_batch_size": None, "train_iterations": 2},
     "HGPOConfig.balance_steps must be false under step_batching 'fixed_budget'"),
    ({"train_forced_steps": False}, "HGPOConfig.train_forced_steps must be true under step_batching 'all_steps'"),
    ({"balance_steps": True, "fill_multiple": 8},  # the default fill, pad: nothing to fill
     "HGPOConfig.fill_multiple must be None unless balance_steps is true and fill_last_micro_batch is 'duplicate'"),
    ({"balance_steps": True, "fill_last_micro_batch": "duplicate", "fill_multiple": 6},
     r"HGPOConfig.fill_multiple must be None or a positive multiple of per_device_train_batch_size \(4\)"),
])
def test_bad_all_steps_settings_name_the_field(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        all_steps_config(tmp_path, **overrides)


def test_an_iteration_cadence_and_a_step_strategy_are_not_both_set(tmp_path):
    with pytest.raises(ValueError, match="set save_every_iterations or save_strategy"):
        make_config(tmp_path, save_every_iterations=1, save_strategy="steps", save_steps=2)
    with pytest.raises(ValueError, match="multiple of eval_every_iterations"):
        make_config(tmp_path, save_every_iterations=3, eval_every_iterations=2, load_best_model_at_end=True,
                    metric_for_best_model="success_rate")


# ------------------------------------------------------------------ training
@pytest.fixture
def unique_advantages():
    """An estimator whose every step has its own advantage, so a row seen by the loss names its step."""
    seen = []

    def estimator(batch):
        values = 0.01 * (np.arange(len(batch)) + 1) + 0.5 * (np.arange(len(batch)) % 2)
        seen.append(values)
        return values

    register_estimator("test_unique", estimator)
    yield seen
    ESTIMATORS.pop("test_unique")


def loss_inputs(trainer):
    """Wrap the loss: record each micro-batch's real rows' advantages and whether old log-probs came along."""
    calls = []
    compute = trainer._compute_loss

    def recording(model, inputs):
        real = inputs["completion_mask"].sum(1) > 0
        calls.append({"step": trainer.state.global_step, "advantages": inputs["advantages"][real].tolist(),
                      "old": "old_per_token_logps" in inputs, "rows": int(real.sum()),
                      "width": inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1)})
        return compute(model, inputs)

    trainer._compute_loss = recording
    return calls


def test_the_fixed_budget_draws_only_eligible_steps():
    rng = np.random.default_rng(0)
    eligible = np.array([True, False, True, True, False, True])
    for _ in range(20):
        drawn = select_budget(6, 3, rng, eligible)
        assert len(set(drawn)) == 3 and eligible[drawn].all() and list(drawn) == sorted(drawn)
    assert list(select_budget(6, 5, rng, eligible)) == [0, 2, 3, 5]  # fewer eligible than the budget: all of them
    assert list(select_budget(4, 5, rng)) == [0, 1, 2, 3]


@pytest.mark.parametrize("train_forced_steps", [True, False])
def test_forced_steps_are_drawn_only_when_asked(tmp_path, tiny_model, tiny_tokenizer, train_forced_steps):
    # An expert's keydoor episodes: 4 steps each, the walks to the hall and the vault forced (one admissible action).
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, per_device_train_batch_size=8,
                                                                   train_forced_steps=train_forced_steps))
    rollout = play(scripted(optimal_action), group_size=4, num_tasks=4)
    for step in rollout.steps:
        step.completion.completion_ids = tiny_tokenizer(step.completion.text).input_ids
        step.completion.prompt_ids = tiny_tokenizer(step.prompt).input_ids
    advantages = np.arange(len(rollout.steps), dtype=np.float64)  # each row's advantage names its step
    drawn = []
    for _ in range(4):
        output, selected, samples = budgets.budget_inputs(trainer, rollout, advantages)
        assert samples.kept == len(selected) == 8 and output["advantages"].tolist() == selected.tolist()
        drawn += [rollout.steps[i].forced for i in selected]
    assert set(drawn) == ({True, False} if train_forced_steps else {False})
    # Fewer eligible steps than the budget: all of them, the rest padding (every process keeps the same rows).
    for step in rollout.steps[8:]:
        step.forced = True
    output, selected, samples = budgets.budget_inputs(trainer, rollout, advantages)
    if not train_forced_steps:
        assert selected.tolist() == [i for i in range(8) if not rollout.steps[i].forced]
        assert len(output["advantages"]) == 8 and samples.padded_fraction == (8 - len(selected)) / 8


def optimizer_steps_taken(trainer) -> int:
    return max(int(state["step"]) for state in trainer.optimizer.state.values())


@pytest.mark.parametrize("options", [{}, {"num_iterations": 2}, {"beta": 0.1}, {"shuffle_steps": True},
                                     {"gradient_checkpointing": True}, {"loss_type": "dapo"},
                                     {"balance_steps": True}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_every_collected_step_reaches_the_loss_exactly_once_per_iteration(tmp_path, tiny_model, tiny_tokenizer,
                                                                          unique_advantages, options):
    trainer = make_trainer(tiny_model, tiny_tokenizer, all_steps_config(tmp_path, estimator="test_unique",
                                                                        train_iterations=3, **options))
    calls = loss_inputs(trainer)
    trainer.train()
    passes = options.get("num_iterations", 1)
    seen = sorted(a for c in calls for a in c["advantages"])
    expected = sorted(float(np.float32(a)) for values in unique_advantages for a in values) * 1
    assert seen == sorted(expected * passes)
    logs = [h for h in trainer.state.log_history if "steps/collected" in h]
    assert [h["steps/collected"] for h in logs] == [len(v) for v in unique_advantages]
    windows = [int(np.ceil(np.ceil(len(v) / 4) / 2)) for v in unique_advantages]
    assert [h["steps/optimizer_steps"] for h in logs] == [w * passes for w in windows]
    assert optimizer_steps_taken(trainer) == trainer.state.global_step == sum(windows) * passes
    assert trainer.completed_iterations == 3 and trainer.state.global_step <= trainer.args.max_steps
    # The run's own counters say the same: each collected step went through the loss once per pass, none missed.
    trained = [h for h in trainer.state.log_history if "steps/trained" in h]
    assert [h["steps/trained"] for h in trained] == [len(v) for v in unique_advantages]
    assert [h["steps/trained_passes"] for h in trained] == [len(v) * passes for v in unique_advantages]
    assert all(h["steps/max_untrained"] == 0 for h in trained)
    # Old log-probabilities whenever an iteration makes more than one optimizer step.
    assert all(c["old"] for c in calls)


@pytest.mark.parametrize("balance_steps", [False, True], ids=["own rows", "balanced"])
def test_duplicates_fill_micro_batches_and_are_counted(tmp_path, tiny_model, tiny_tokenizer, unique_advantages,
                                                       balance_steps):
    trainer = make_trainer(tiny_model, tiny_tokenizer, all_steps_config(
        tmp_path, estimator="test_unique", fill_last_micro_batch="duplicate", per_device_train_batch_size=3,
        mini_batch_size=6, max_env_steps=3, balance_steps=balance_steps))
    calls = loss_inputs(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "steps/collected" in h]
    for values, log in zip(unique_advantages, logs, strict=True):
        assert log["steps/duplicated"] == -len(values) % 3
    assert all(c["rows"] in (3, 0) for c in calls)  # full micro-batches, or padding alone
    trained = [h for h in trainer.state.log_history if "steps/trained" in h]
    assert [h["steps/trained_passes"] - h["steps/trained"] for h in trained] == [h["steps/duplicated"] for h in logs]
    seen = [a for c in calls for a in c["advantages"]]
    assert set(seen) == {float(np.float32(a)) for values in unique_advantages for a in values}


def test_padding_alone_is_two_tokens_wide(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, all_steps_config(tmp_path, mini_batch_size=32))
    calls = loss_inputs(trainer)
    trainer.train()
    padding = [c for c in calls if c["rows"] == 0]
    assert padding and all(c["width"] == 2 for c in padding)  # 40 steps at most: 10 real micro-batches of 16 slots


def test_sgd_over_two_mini_batches_equals_the_two_updates_by_hand(tmp_path, tiny_model, tiny_tokenizer,
                                                                  unique_advantages):
    """One iteration of 2 windows with plain SGD: parameters after = theta0 - lr (g1(theta0) + g2(theta1)), with
    the clipped ratio of the second window taken against log-probabilities from before the first update."""
    lr = 0.05
    args = all_steps_config(tmp_path, train_iterations=1, max_env_steps=2, per_device_train_batch_size=4,
                            mini_batch_size=8, loss_type="bnpo", max_grad_norm=0.0, learning_rate=lr,
                            entropy_coef=0.0, lr_scheduler_type="constant", estimator="test_unique")
    by_hand = copy.deepcopy(tiny_model)  # before the Trainer wraps the model's forward
    optimizer = torch.optim.SGD(tiny_model.parameters(), lr=lr)
    trainer = make_trainer(tiny_model, tiny_tokenizer, args, optimizers=(optimizer, None))
    theta0 = snapshot(tiny_model)
    kept = []
    original = trainer._all_steps_iteration
    trainer._all_steps_iteration = lambda: kept.extend(original()) or list(kept)
    trainer.train()
    assert len(kept) == 4 and trainer.state.global_step == 2  # 16 steps: 4 micro-batches, 2 windows

    def token_logps(model, mb):
        ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
        mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, mb["prompt_ids"].size(1) - 1:-1]
        return torch.log_softmax(logits.float() / args.temperature, -1).gather(-1, mb["completion_ids"][..., None])[..., 0]

    ratios = []
    for window in (kept[:2], kept[2:]):
        by_hand.zero_grad()
        for mb in window:
            logps = token_logps(by_hand, mb)
            ratio = torch.exp(logps - mb["old_per_token_logps"])
            ratios.append(ratio.detach()[mb["completion_mask"].bool()])
            advantage = mb["advantages"][:, None]
            per_token = -torch.min(ratio * advantage, torch.clamp(ratio, 0.8, 1.2) * advantage)
            token_mean = (per_token * mb["completion_mask"]).sum() / mb["completion_mask"].sum().clamp(min=1)
            (token_mean / 2).backward()  # each micro-batch's token mean over the fixed accumulation count
        with torch.no_grad():
            for p in by_hand.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    after = snapshot(tiny_model)
    for name, value in by_hand.named_parameters():
        assert torch.allclose(after[name], value.detach(), atol=1e-6), name
    assert any(not torch.equal(after[k], theta0[k]) for k in theta0)
    assert all(torch.allclose(r, torch.ones_like(r), atol=1e-5) for r in ratios[:2])  # window 1: theta0 itself
    assert any((r - 1).abs().max() > 1e-4 for r in ratios[2:])  # window 2: the ratio has moved


def test_lora_trains_under_all_steps(tmp_path, tiny_model, tiny_tokenizer):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tiny_model, tiny_tokenizer, all_steps_config(tmp_path, beta=0.05), peft_config=lora)
    before = snapshot(trainer.model)
    trainer.train()
    moved = [k for k, v in snapshot(trainer.model).items() if not torch.equal(v, before[k])]
    assert moved and all("lora" in k for k in moved)


def test_iterations_drive_the_schedule_evaluation_and_checkpoints(tmp_path, tiny_model, tiny_tokenizer):
    args = all_steps_config(tmp_path, train_iterations=4, eval_every_iterations=2, save_every_iterations=3,
                            lr_scheduler_type="linear", learning_rate=0.01)
    trainer = make_trainer(tiny_model, tiny_tokenizer, args)
    trainer.train()
    history = trainer.state.log_history
    train = [h for h in history if "loss" in h and "iteration" in h]
    # One learning rate per iteration, decaying linearly over the 4 iterations.
    rates = {h["iteration"]: h["learning_rate"] for h in train}
    assert [round(rates[i], 6) for i in (1, 2, 3, 4)] == [0.01, 0.0075, 0.005, 0.0025]
    assert all(h["learning_rate"] == rates[h["iteration"]] for h in train)
    # Evaluations after iterations 2 and 4; checkpoints after iteration 3 and at the end.
    ends = {i: max(h["step"] for h in train if h["iteration"] == i) for i in rates}
    assert [h["step"] for h in history if "eval_success_rate" in h] == [ends[2], ends[4]]
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    assert saved == [ends[3], ends[4]]
    state = (tmp_path / "out" / f"checkpoint-{ends[3]}" / "hgpo_trainer_state_0.json").read_text()
    assert '"iterations": 3' in state


def test_a_resumed_all_steps_run_continues_the_iterations(tmp_path, tiny_model, tiny_tokenizer):
    args = all_steps_config(tmp_path, train_iterations=2, save_every_iterations=1)
    first = make_trainer(tiny_model, tiny_tokenizer, args)
    first.train()
    one = min((tmp_path / "out").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    resumed = make_trainer(type(tiny_model)(tiny_model.config), tiny_tokenizer, args)
    played = []
    original = resumed._play_iteration
    resumed._play_iteration = lambda tasks: played.append([t["task_id"] for t in tasks]) or original(tasks)
    resumed.train(resume_from_checkpoint=str(one))
    assert resumed.completed_iterations == 2 and len(played) == 1
    assert played[0] == [resumed.train_dataset[i]["task_id"] for i in resumed._task_sampler.iteration_tasks(1, 0, 1)]


class FaultsInIterations(KeyDoorEnv):
    """Keydoor whose resets raise in the given (1-based) iterations: every episode of those iterations fails, so
    they collect no step (one reset per environment and iteration)."""

    iterations: tuple[int, ...] = ()

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.resets = 0

    def reset(self, task):
        self.resets += 1
        if self.resets in self.iterations:
            raise RuntimeError("injected: the environment is down")
        return super().reset(task)


def faulting_in(*iterations):
    return type("Faulting", (FaultsInIterations,), {"iterations": iterations})


def test_a_last_iteration_without_steps_ends_the_run_with_its_checkpoint(tmp_path, tiny_model, tiny_tokenizer):
    args = all_steps_config(tmp_path, train_iterations=3, save_every_iterations=1, max_faulty_iterations=0)
    trainer = make_trainer(tiny_model, tiny_tokenizer, args, env_factory=faulting_in(3))
    trainer.train()  # used to raise "no environment step was collected"
    assert trainer.completed_iterations == 3
    logs = [h for h in trainer.state.log_history if "steps/collected" in h]
    assert [h["steps/collected"] for h in logs][-1] == 0
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    assert saved[-1] == trainer.state.global_step  # the final checkpoint, after the last iteration
    state = json.loads((tmp_path / "out" / f"checkpoint-{saved[-1]}" / "hgpo_trainer_state_0.json").read_text())
    assert state["iterations"] == 3


def test_the_last_window_of_an_empty_iteration_moves_no_parameter(tmp_path, tiny_model, tiny_tokenizer):
    args = all_steps_config(tmp_path, train_iterations=2, max_faulty_iterations=0)
    trainer = make_trainer(tiny_model, tiny_tokenizer, args, env_factory=faulting_in(2))
    after_first = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if trainer.completed_iterations == 1 and not after_first:
                after_first.update(snapshot(tiny_model))

    trainer.add_callback(Snapshot())
    trainer.train()
    assert after_first and all(torch.equal(v, after_first[k]) for k, v in snapshot(tiny_model).items())


def test_the_cadence_counts_iterations_that_trained_nothing(tmp_path, tiny_model, tiny_tokenizer):
    """Iteration 2 collects no step: iteration 3 is played in the same optimizer step, and the evaluation and
    checkpoint due after iteration 2 come at that boundary rather than being skipped."""
    args = all_steps_config(tmp_path, train_iterations=4, eval_every_iterations=2, save_every_iterations=2,
                            max_faulty_iterations=0)
    trainer = make_trainer(tiny_model, tiny_tokenizer, args, env_factory=faulting_in(2))
    trainer.train()
    assert sum("eval_success_rate" in h for h in trainer.state.log_history) == 2
    assert len(list((tmp_path / "out").glob("checkpoint-*"))) == 2


def test_the_schedule_reads_the_iterations_from_a_shallow_copy_too(tmp_path, tiny_model, tiny_tokenizer):
    """The Trainer builds a DeepSpeed-config scheduler on copy.copy(trainer): the count must be shared."""
    trainer = make_trainer(tiny_model, tiny_tokenizer, all_steps_config(tmp_path, train_iterations=4, learning_rate=0.01,
                                                                        lr_scheduler_type="linear"))
    trainer.create_optimizer()
    shallow = copy.copy(trainer)
    schedule = shallow.create_scheduler(100, trainer.optimizer)
    trainer._iteration = 2  # two iterations done, at a boundary
    schedule.step()
    assert schedule.get_last_lr()[0] == pytest.approx(0.005)


def test_fixed_budget_saves_after_the_last_iteration_too(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, train_iterations=4,
                                                                   save_every_iterations=3))
    trainer.train()
    assert sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*")) == [3, 4]


def test_eval_every_iterations_needs_an_eval_dataset(tmp_path, tiny_model, tiny_tokenizer):
    from hgpo_trl.trainer import HGPOTrainer

    with pytest.raises(ValueError, match="eval_every_iterations needs an eval_dataset"):
        HGPOTrainer(model=tiny_model, args=make_config(tmp_path, eval_every_iterations=1),
                    processing_class=tiny_tokenizer, train_dataset=make_tasks("keydoor", "train", num_tasks=4))


def test_a_micro_batch_that_skips_steps_is_seen_by_the_counters(tmp_path, tiny_model, tiny_tokenizer):
    """The counters check what reached the loss, not the plan: drop one micro-batch's rows and they say so."""
    trainer = make_trainer(tiny_model, tiny_tokenizer, all_steps_config(tmp_path, train_iterations=1))
    original = trainer._all_steps_iteration

    def losing_one_micro_batch():
        batches = original()
        batches[0]["step_rows"] = torch.full_like(batches[0]["step_rows"], -1)
        return batches

    trainer._all_steps_iteration = losing_one_micro_batch
    trainer.train()
    collected = next(h for h in trainer.state.log_history if "steps/collected" in h)["steps/collected"]
    trained = next(h for h in trainer.state.log_history if "steps/trained" in h)
    assert trained["steps/max_untrained"] == 4 and trained["steps/trained"] == collected - 4



def test_a_fill_larger_than_the_rows_a_process_plays_still_completes_every_iteration(tmp_path, tiny_model,
                                                                                     tiny_tokenizer):
    """1 task x 2 rollouts x 2 steps is 4 rows at most, filled to 16 (fill_multiple): 8 micro-batches of 2 and 8
    optimizer steps an iteration. max_steps, all_steps' bound, must count the fill, or the run stops at the
    bound inside iteration 1 without a word."""
    trainer = make_trainer(tiny_model, tiny_tokenizer, all_steps_config(
        tmp_path, balance_steps=True, fill_last_micro_batch="duplicate", fill_multiple=16, tasks_per_device=1,
        num_generations=2, max_env_steps=2, per_device_train_batch_size=2, mini_batch_size=2))
    assert trainer.args.max_steps >= 2 * 8
    trainer.train()
    assert trainer.completed_iterations == 2
    assert [h["steps/trained_passes"] for h in trainer.state.log_history if "steps/trained_passes" in h] == [16, 16]
