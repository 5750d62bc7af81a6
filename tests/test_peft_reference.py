"""The KL reference of a model passed in already wrapped as a PeftModel (issue 18): TRL keeps the starting
adapter as the reference (a frozen "ref" copy); a new adapter's reference is the base model. And the base of a
LoRA run after a warm start (issue 31): saved once, the one that training, resume, merge and evaluation use."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hgpo_trl.envs import make_tasks
from tests.test_trainer import make_config, make_trainer


def token_logps(trainer, batch, adapter_enabled: bool) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        if adapter_enabled:
            return trainer._get_per_token_logps_and_entropies(model, ids, mask, batch["completion_ids"].size(1))[0]
        with model.disable_adapter():
            return trainer._get_per_token_logps_and_entropies(model, ids, mask, batch["completion_ids"].size(1))[0]


def test_a_pretrained_adapter_is_its_own_reference(tmp_path, tiny_model, tiny_tokenizer):
    # A trained adapter stands in as random LoRA weights (init_lora_weights=False): not the base model.
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                      init_lora_weights=False)
    model = get_peft_model(tiny_model, lora)
    trainer = make_trainer(model, tiny_tokenizer, make_config(tmp_path, beta=0.1))
    assert "ref" in trainer.accelerator.unwrap_model(trainer.model).peft_config
    trainer.model.train()
    batch = trainer._generate_and_score_completions(list(make_tasks("keydoor", "train", num_tasks=2)))
    mask = batch["completion_mask"].bool()
    ref = batch["ref_per_token_logps"][mask]
    # Before any update the "ref" copy equals the adapter being trained, and differs from the base model.
    assert torch.allclose(ref, token_logps(trainer, batch, adapter_enabled=True)[mask], atol=1e-5)
    assert (ref - token_logps(trainer, batch, adapter_enabled=False)[mask]).abs().max() > 1e-3


def embeddings(folder) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).get_input_embeddings().weight.detach()


def test_lora_after_a_warm_start_trains_resumes_merges_and_evaluates_on_the_warm_started_base(
        tmp_path, monkeypatch, tiny_tokenizer):
    """train.py with use_peft and a warm start: a PEFT checkpoint holds the adapter alone, and the base was the
    warm start in memory only. A resumed run trained its adapter on a fresh, never warm-started base, and
    adapter_config.json named no base (tiny) or the raw one (a hub model), so hgpo-merge and hgpo-eval rebuilt a
    model that was never trained. The warm-started base is saved once, in output_dir/base_model, and everything
    points at it."""
    from hgpo_trl.commands import evaluate, players
    from hgpo_trl.commands.train import main
    from hgpo_trl.models.export import main as merge
    from hgpo_trl.trainer import HGPOTrainer
    from tests.test_cli import TINY_RUN, write

    trainers = []
    train = HGPOTrainer.train
    monkeypatch.setattr(HGPOTrainer, "train", lambda self, *a, **k: trainers.append(self) or train(self, *a, **k))
    lora = ("use_peft: true\nlora_r: 4\nlora_alpha: 8\nlora_target_modules: [q_proj, v_proj]\nwarmstart_steps: 3\n"
            "warmstart_batch_size: 8\nsave_strategy: steps\nsave_steps: 1\nplots: false\nbeta: 0.1\n")
    main(["--config", write(tmp_path, TINY_RUN + lora + "train_iterations: 2\n")])
    out = tmp_path / "out"
    base = embeddings(out / "base_model")
    fresh = trainers[0].accelerator.unwrap_model(trainers[0].model).get_base_model()
    assert torch.equal(fresh.get_input_embeddings().weight.detach(), base)  # the run trained on the saved base
    main(["--config", write(tmp_path, TINY_RUN + lora + "train_iterations: 3\n"),
          "--resume_from_checkpoint", str(out / "checkpoint-2")])
    resumed = trainers[1].accelerator.unwrap_model(trainers[1].model).get_base_model()
    assert torch.equal(resumed.get_input_embeddings().weight.detach(), base), "the resumed run's base"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(out / "base_model")
    assert merge([str(out), str(tmp_path / "merged")]) == 0
    assert torch.equal(embeddings(tmp_path / "merged"), base)  # LoRA on q/v: the embeddings are the base's
    config = write(tmp_path, TINY_RUN + lora, model=str(out))
    args = evaluate.prepare(["--config", config])
    model, _ = players.load_model(args.model_args, args.env_args, args.args)
    assert torch.equal(model.get_input_embeddings().weight.detach(), base)
    evaluate.main(["--config", config, "--seeds", "1", "--eval_output_dir", str(tmp_path / "eval")])
    assert (tmp_path / "eval" / "evaluation.json").is_file()


def test_a_notebook_s_warm_started_model_with_lora_saves_an_evaluable_folder(tmp_path, tiny_model, tiny_tokenizer):
    """The Python API: a model built in memory, warm-started, trained with peft_config, save_model(): the folder
    named no base model (null), so hgpo-eval stopped; it names the saved base now."""
    from trl import ModelConfig

    from hgpo_trl.commands import players
    from hgpo_trl.commands.arguments import EnvArguments
    from hgpo_trl.envs import make_env
    from hgpo_trl.models.warmstart import warm_start

    warm_start(tiny_model, tiny_tokenizer, lambda: make_env("keydoor", max_steps=5),
               list(make_tasks("keydoor", "train", num_tasks=4)), steps=2, max_steps=5, batch_size=8)
    base = tiny_model.get_input_embeddings().weight.detach().clone()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, train_iterations=1), peft_config=lora)
    trainer.train()
    trainer.save_model()
    out = tmp_path / "out"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(out / "base_model")
    assert torch.equal(embeddings(out / "base_model"), base)
    model, _ = players.load_model(ModelConfig(model_name_or_path=str(out)), EnvArguments(), trainer.args)
    assert torch.equal(model.get_input_embeddings().weight.detach(), base)


def test_a_saved_base_named_by_the_user_is_the_adapter_s_base(tmp_path, tiny_model, tiny_tokenizer):
    """A notebook that saves its warm-started base and sets config._name_or_path to it: PEFT wrote null (it reads
    the name the model was built with)."""
    tiny_model.save_pretrained(tmp_path / "mine")
    tiny_model.config._name_or_path = str(tmp_path / "mine")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path, train_iterations=1), peft_config=lora)
    trainer.save_model()
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(tmp_path / "mine")


def test_a_resume_the_config_does_not_announce_is_refused_when_the_start_was_saved(tmp_path, tiny_model,
                                                                                      tiny_tokenizer):
    """trainer.train(resume_from_checkpoint=...) alone: the trainer had saved the model passed in as the run's base
    over the one the run started from; it says to set HGPOConfig.resume_from_checkpoint instead."""
    from hgpo_trl.training.checkpoints import ResumeError

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tiny_model, tiny_tokenizer, make_config(tmp_path), peft_config=lora)
    with pytest.raises(ResumeError, match="set HGPOConfig.resume_from_checkpoint to it too"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert trainer.state.global_step == 0
