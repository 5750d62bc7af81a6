"""The KL reference of a model passed in already wrapped as a PeftModel (issue 18): TRL keeps the starting
adapter as the reference (a frozen "ref" copy); a new adapter's reference is the base model."""

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
