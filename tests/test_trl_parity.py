"""What a TRL user expects of GRPOTrainer, kept by HGPOTrainer (issue 18, "also found"): its metrics, the
tensors its loss reads, gradient checkpointing off for the log-probability passes, FSDP's gathered parameters
for generation, and clear refusals where a TRL option cannot work here."""

import contextlib

import numpy as np
import pytest
import torch

from hgpo_trl.envs import make_tasks
from hgpo_trl.rollout.generation import prompt_budget
from hgpo_trl.rollout.lockstep import Completion, StepRecord
from hgpo_trl.training.loss_inputs import logprob_inputs
from hgpo_trl.training.step_batches import sampling_metrics
from tests.test_trainer import make_config, make_trainer


def test_trl_metrics_are_logged(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, max_completion_length=3))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "env/success_rate" in h]
    for key in ("completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/clipped_ratio", "num_tokens"):
        assert key in logs[0], key
    first = logs[0]
    assert 1 <= first["completions/min_length"] <= first["completions/mean_length"] <= first["completions/max_length"] <= 3
    assert 0 <= first["completions/clipped_ratio"] <= 1
    assert logs[1]["num_tokens"] > logs[0]["num_tokens"] > 0  # cumulative, as TRL's


def test_sampling_metrics_by_hand():
    old = torch.tensor([[-1.0, -2.0, -4.0]])
    sampling = torch.tensor([[-1.5, float("nan"), -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    ratio = torch.tensor([[1.5, 1.0, 9.0]])
    metrics = sampling_metrics(old, sampling, ratio, mask)
    # Token 2 is unscored (NaN) and token 3 masked: only |(-1) - (-1.5)| = 0.5 counts; the ratio over tokens 1-2.
    assert metrics["sampling/sampling_logp_difference/mean"] == metrics["sampling/sampling_logp_difference/max"] == 0.5
    assert (metrics["sampling/importance_sampling_ratio/min"], metrics["sampling/importance_sampling_ratio/max"]) == (1.0, 1.5)


def steps_with_logprobs(samples_tokens: list[list[int]]) -> list[StepRecord]:
    return [StepRecord(group=0, traj=i, step=0, observation="o", prompt="p",
                       completion=Completion(text="x", prompt_ids=[5, 6], completion_ids=ids,
                                             logprobs=[-0.5] * len(ids)),
                       action="x", reward=0.0, shown_history=0) for i, ids in enumerate(samples_tokens)]


def test_vllm_sampling_logprobs_reach_the_loss_without_the_correction(tmp_path, tiny_model, tiny_tokenizer):
    """TRL passes sampling_per_token_logps whenever vLLM gave them (its off-policy mask reads them), with or
    without the importance-sampling correction. (vLLM itself needs a GPU: the steps carry its log-probs.)"""
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path))
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, False
    steps = steps_with_logprobs([[7, 8], [9]])
    completions = [s.completion for s in steps]
    samples = trainer._samples(completions, torch.zeros(2).numpy(), padding=1)
    out = logprob_inputs(trainer, samples, completions, old=False)
    assert out["sampling_per_token_logps"].shape == samples["completion_ids"].shape
    assert out["sampling_per_token_logps"][0].tolist() == [-0.5, -0.5] and "importance_sampling_ratio" not in out


def test_vllms_correction_at_one_optimizer_step_a_generation_comes_from_the_losss_own_forward(
        tmp_path, tiny_model, tiny_tokenizer):
    """At one optimizer step per generation the old log-probabilities are the loss's own, detached: vLLM's
    importance-sampling correction takes them from the loss's forward, not from a no-grad forward of their own
    (TRL's: one more forward per generation), with the same ratio, loss, gradients and sampling/* metrics as that
    forward gives; a failed loss leaves no forward after it marked. (Before: the no-grad forward ran at every
    generation.)"""
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path))
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    completions = [s.completion for s in steps_with_logprobs([[7, 8], [9]])]
    samples = trainer._samples(completions, np.array([1.0, -1.0]), padding=1)
    samples["num_items_in_batch"] = samples["completion_mask"].sum()
    forwards = []
    compute = trainer._get_per_token_logps_and_entropies

    def counted(*args, **kwargs):
        forwards.append(torch.is_grad_enabled())
        return compute(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counted
    with torch.no_grad():
        deferred = {**samples, **logprob_inputs(trainer, samples, completions, old=False)}
        assert forwards == [] and "importance_sampling_ratio" not in deferred
        prepared = {**samples, **logprob_inputs(trainer, samples, completions, old=True)}
    assert forwards == [False]
    results = []
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # (the Trainer's training loop sets it)
    for inputs in (prepared, deferred):
        trainer.model.zero_grad()
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None],
                        {k: v for k, v in trainer._metrics["train"].items() if k.startswith("sampling/")}))
    assert forwards == [False, True, True] and trainer._ratio_inputs is None  # one forward each: the loss's
    with pytest.raises(KeyError):
        trainer.compute_loss(trainer.model, {key: value for key, value in samples.items() if key != "completion_mask"})
    assert trainer._ratio_inputs is None
    torch.testing.assert_close(deferred["importance_sampling_ratio"], prepared["importance_sampling_ratio"])
    assert not torch.equal(prepared["importance_sampling_ratio"], torch.ones_like(prepared["importance_sampling_ratio"]))
    (loss, grads, _), (deferred_loss, deferred_grads, metrics) = results
    torch.testing.assert_close(deferred_loss, loss)
    assert len(grads) == len(deferred_grads) > 0
    for grad, deferred_grad in zip(grads, deferred_grads, strict=True):
        torch.testing.assert_close(deferred_grad, grad)
    expected = sampling_metrics(prepared["old_per_token_logps"], prepared["sampling_per_token_logps"],
                                prepared["importance_sampling_ratio"], samples["completion_mask"])
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == [pytest.approx(value, rel=1e-5)], key


def test_the_log_probability_passes_run_without_gradient_checkpointing(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, gradient_checkpointing=True, beta=0.1,
                                                                   num_iterations=2))
    seen = []
    compute = trainer._get_per_token_logps_and_entropies

    def recording(model, *args, **kwargs):
        if not torch.is_grad_enabled():
            seen.append(trainer.accelerator.unwrap_model(trainer.model).is_gradient_checkpointing)
        return compute(model, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = recording
    trainer.train()
    assert seen and not any(seen)  # old (num_iterations 2) and reference (beta) passes, checkpointing off
    assert trainer.accelerator.unwrap_model(trainer.model).is_gradient_checkpointing  # back on for training


def test_generation_gathers_fsdp_parameters(tmp_path, tiny_model, tiny_tokenizer):
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path))
    entered = []

    @contextlib.contextmanager
    def summon(module, **kwargs):
        entered.append(kwargs)
        yield

    trainer._dist.summon_full_params = summon
    trainer._play(list(make_tasks("keydoor", "train", num_tasks=1)), 2, 1.0)
    assert entered == [{"recurse": False}]  # once per rollout, as TRL does per generation batch


def test_the_default_prompt_budget_is_the_generators_context():
    assert prompt_budget(32768, None, 512) == 32256
    assert prompt_budget(32768, 4608, 512) == 4096  # vLLM's lowered max_model_len, not the model's
    assert prompt_budget(None, None, 512) is None and prompt_budget(256, None, 512) is None


@pytest.mark.parametrize(("overrides", "message"), [
    ({"push_to_hub": True, "hub_strategy": "checkpoint", "hub_model_id": "me/run"}, "hub_strategy='checkpoint'"),
    ({"push_to_hub": True, "hub_strategy": "all_checkpoints", "hub_model_id": "me/run"}, "use 'every_save' or 'end'"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"}, "needs metric_for_best_model"),
])
def test_options_that_cannot_work_are_refused_with_the_reason(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(tmp_path, **overrides)
