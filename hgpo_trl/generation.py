"""Prompt encoding and transformers generation shared by the trainer's rollouts and `hgpo-eval`, so that both
play the same prompts and cut the same completions."""

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import GenerationConfig
from trl.trainer.utils import pad


def encode_prompt(tokenizer, text: str, chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The prompt's ids: one user turn of the chat template with its generation prompt, or the plain text when
    the tokenizer has no template."""
    if tokenizer.chat_template is None:
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True, **(chat_template_kwargs or {}))["input_ids"]


@torch.no_grad()
def generate_completions(model, config: GenerationConfig, prompt_ids: list[list[int]], pad_token_id: int,
                         eos_token_ids: list[int]) -> list[list[int]]:
    """One left-padded `generate` call; each completion cut after its first end token (kept)."""
    tensors = [torch.tensor(ids) for ids in prompt_ids]
    input_ids = pad(tensors, padding_value=pad_token_id, padding_side="left").to(model.device)
    attention_mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left").to(model.device)
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    completions = output[:, input_ids.size(1):].cpu()
    is_eos = torch.isin(completions, torch.tensor(eos_token_ids))
    ends = torch.where(is_eos.any(1), is_eos.int().argmax(1), completions.size(1))
    return [row[: end + 1].tolist() for row, end in zip(completions, ends.tolist(), strict=True)]


def slices_by_position(use_vllm: bool, vllm_mode: str, tensor_parallel_size: int) -> bool:
    """Whether the generation backend hands each process its completions by position in a shared batch, which
    needs the same prompt count on every process: vLLM's server mode, and colocated vLLM with tensor
    parallelism (TRL gathers a tensor-parallel group's prompts and slices the outputs by the local count)."""
    return use_vllm and (vllm_mode == "server" or tensor_parallel_size > 1)


def prompts_per_call(local: int, counts: Sequence[int] | None) -> int:
    """How many prompts a process sends to one collective generate call: its own `local` count or, when the
    backend slices by position, the busiest process's (`counts`: every process's), the rest dummy prompts; at
    least 1, so that a process with no live episode still joins the call."""
    return max(max(counts) if counts is not None else local, 1)


def prompt_budget(max_position_embeddings: int | None, vllm_max_model_length: int | None,
                  max_completion_length: int | None) -> int | None:
    """The default max_prompt_tokens: the generator's context (vLLM's max_model_length when it is set, which
    users lower to save KV cache: a longer prompt would fail one process's call and hang the others; else the
    model's) minus max_completion_length. None when the context is unknown or too short to leave room."""
    context = vllm_max_model_length or max_position_embeddings
    completion = max_completion_length or 0
    return context - completion if context and context > completion else None


def control_text_guard(tokenizer) -> Callable[[str], str]:
    """A function that keeps text from spelling one of `tokenizer`'s added tokens (Qwen's `<|im_end|>`,
    `<|im_start|>`, `<|endoftext|>`; Qwen3's `<think>` and `</think>`): each occurrence gets a space after its
    first character, so it tokenizes as text. Environment text (observations, the task, admissible actions) and
    the memory pass through it before a prompt is rendered: an observation that says `<|im_end|>` must not end
    the user turn. The format instruction and the environment's own template are not passed through: their tags
    are meant. Whitespace-only added tokens (the tiny tokenizer's newline) are left alone."""
    added = {token.content for token in tokenizer.added_tokens_decoder.values() if token.content.strip()}
    if not added:
        return lambda text: text
    pattern = re.compile("|".join(re.escape(token) for token in sorted(added, key=len, reverse=True)))
    return lambda text: pattern.sub(lambda match: f"{match[0][0]} {match[0][1:]}", text)


def generation_settings(settings, tokenizer, model_config, vllm_max_model_length: int | None,
                        max_completion_length: int | None):
    """`settings` (RolloutSettings) for playing with `tokenizer` and this model: environment text guarded
    against spelling control tokens, and, when no max_prompt_tokens was set, prompts fitted to the generator's
    context minus the completion. The trainer and hgpo-eval both play with these, so they play the same prompts."""
    import dataclasses

    budget = settings.max_prompt_tokens
    if budget is None:
        budget = prompt_budget(getattr(model_config, "max_position_embeddings", None), vllm_max_model_length,
                               max_completion_length)
    return dataclasses.replace(settings, max_prompt_tokens=budget, escape_text=control_text_guard(tokenizer))
