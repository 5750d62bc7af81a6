"""Generation: a model as a rollout policy. Prompt encoding, transformers generation and `ModelPolicy` are shared
by the trainer's rollouts and `hgpo-eval`, so that both play the same prompts and cut the same completions; the
trainer's backend (vLLM, or its own model with ZeRO-3 / FSDP weights gathered) is `trainer_generator`, and
`trainer_rollout` plays one rollout with it, every process in step with the others."""

import copy
import dataclasses
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from transformers import GenerationConfig
from trl.models.utils import unwrap_model_for_generation
from trl.trainer.utils import pad

from hgpo_trl.rollout.continuous import CompletionStream, PolicyStream, run_continuous
from hgpo_trl.rollout.lockstep import Completion, Rollout, run_rollout
from hgpo_trl.rollout.vllm_cpu import sync_weights
from hgpo_trl.rollout.vllm_stream import (
    ServerRequests,
    ServerStream,
    VLLMStream,
    abort_unfinished,
    sampled_logprobs,
)
from hgpo_trl.runtime.collective import any_process, process_values
from hgpo_trl.runtime.progress import progress_bar
from hgpo_trl.runtime.seeds import integer_seed

# generate(prompt_ids) -> (completion_ids, sampling log-probabilities per token, or None when the backend has none)
Generate = Callable[[list[list[int]]], tuple[list[list[int]], list[list[float]] | None]]


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
    budget = settings.max_prompt_tokens
    if budget is None:
        budget = prompt_budget(getattr(model_config, "max_position_embeddings", None), vllm_max_model_length,
                               max_completion_length)
    return dataclasses.replace(settings, max_prompt_tokens=budget, escape_text=control_text_guard(tokenizer))


class ModelPolicy:
    """A model as a rollout policy: each turn's prompts go to one `generate` call, encoded with the chat template
    and its generation prompt (the plain text when the tokenizer has none). `call_size(n)`: how many prompts a
    call must hold when this process has `n` (a collective backend needs every process in every call, with the
    same count when it slices by position): the rest are dummy prompts, their completions dropped."""

    def __init__(self, tokenizer, generate: Generate, chat_template_kwargs: Mapping[str, Any] | None = None,
                 call_size: Callable[[int], int] | None = None):
        self.tokenizer, self.generate, self.call_size = tokenizer, generate, call_size
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._encoded: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text, self.chat_template_kwargs)

    def count_tokens(self, text: str) -> int:
        # The rollout counts tokens to fit each prompt to the context: keep the ids for generation.
        self._encoded[text] = self.encode(text)
        return len(self._encoded[text])

    def prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        """The ids of prompts just fitted (kept from count_tokens); the fitting attempts are dropped."""
        prompt_ids = [self._encoded[p] if p in self._encoded else self.encode(p) for p in prompts]
        self._encoded.clear()
        return prompt_ids

    def __call__(self, prompts: list[str]) -> list[Completion]:
        prompt_ids = self.prompt_ids(prompts)
        count = self.call_size(len(prompt_ids)) if self.call_size else len(prompt_ids)
        padded = prompt_ids + [self.encode("")] * (count - len(prompt_ids))
        if padded:
            completion_ids, logprobs = self.generate(padded)
        if not prompt_ids:  # (batch_decode([]) is not [])
            return []
        completion_ids = completion_ids[: len(prompt_ids)]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return [Completion(text=text, prompt_ids=p, completion_ids=c, logprobs=None if logprobs is None else logprobs[i])
                for i, (text, p, c) in enumerate(zip(texts, prompt_ids, completion_ids, strict=True))]


def sampling_config(config: GenerationConfig, temperature: float) -> GenerationConfig:
    """A copy of `config` that samples at `temperature`, or decodes greedily at 0 (without the sampling
    settings, TRL's top_k 0 among them, which would only draw warnings)."""
    config = copy.deepcopy(config)
    config.do_sample = temperature > 0
    if config.do_sample:
        config.temperature = temperature
    else:
        config.temperature, config.top_k = 1.0, None
    return config


def push_weights(trainer) -> None:
    """The trainer's weights into its vLLM engine, once per optimizer step (every process: ZeRO-3's gathers are
    collective), its seconds logged (`time/weight_push`, this process's), and the rollouts played ahead told
    (`async_generation`), or handed the server's failure."""
    step, ahead = trainer.state.global_step, getattr(trainer, "_ahead", None)
    if step != trainer._last_loaded_step:  # TRL's own record of the synced step
        tick = time.perf_counter()
        try:
            sync_weights(trainer.vllm_generation, step, trainer.args.vllm_request_timeout)
        except RuntimeError as err:  # (a server's one line)
            if ahead is None:
                raise
            ahead.push_failed(err)  # raised where every process takes the next rollout: a checkpoint, the stop
            return
        trainer._last_loaded_step = step
        trainer._metrics["train"]["time/weight_push"].append(time.perf_counter() - tick)
    if ahead is not None:
        ahead.pushed(step)


def training_rollout_seed(seed: int, rank: int, iteration: int, batch: int = 0) -> int:
    """The seed of a training rollout's requests (vLLM draws each request's from it): from the run's seed, the
    process, the iteration and its rollout batch (dynamic sampling plays several), so that a resumed run and one
    that plays ahead (`async_generation`) draw what the synchronous run does."""
    return integer_seed(seed, "training_requests", rank, iteration, batch)


@contextmanager
def trainer_generator(trainer, temperature: float) -> Iterator[Generate]:
    """The trainer's `Generate` for one whole rollout: TRL's vLLM backend (weights synced once per rollout, at a
    new optimizer step; a rollout that an exception ends leaves no request in a colocated engine) or the policy
    model itself, unwrapped with ZeRO-3 / FSDP weights gathered once per rollout, not once per turn."""
    if trainer.use_vllm:
        backend = trainer.vllm_generation
        push_weights(trainer)
        previous, backend.temperature = backend.temperature, temperature

        def generate(prompt_ids):
            _, completion_ids, logprobs, _ = backend.generate(prompts=prompt_ids, images=None, num_generations=1)
            return completion_ids, sampled_logprobs(logprobs)

        try:
            yield generate
        except BaseException:
            if backend.mode == "colocate":  # (a server finishes an interrupted call's requests on its own)
                abort_unfinished(backend.llm.llm_engine)
            raise
        finally:
            backend.temperature = previous
        return
    config = sampling_config(trainer.generation_config, temperature)
    with (unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                      gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                                      generation_kwargs=trainer.generation_kwargs,
                                      gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)
          as model, torch.no_grad(),
          # FSDP (v1) shards the parameters: gather them for generation, as TRL does (a no-op otherwise).
          trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False)):
        pad_token_id = trainer._tokenizer.pad_token_id  # (TRL's: the tokenizer of a processor too)
        yield lambda prompt_ids: (generate_completions(model, config, prompt_ids, pad_token_id,
                                                       trainer.eos_token_ids), None)


@contextmanager
def completion_stream(trainer, policy: ModelPolicy, temperature: float, concurrency: int,
                      rollout_seed: int | None) -> Iterator[CompletionStream]:
    """The continuous rollout's stream: colocated vLLM's requests, a server's (up to `concurrency` in flight; the
    main process uses TRL's client, the others a client of their own), or transformers' generate on the prompts
    waiting. vLLM draws each request's seed from `rollout_seed` (None: one from this process's generation stream)."""
    if not trainer.use_vllm:
        yield PolicyStream(policy)
        return
    prompt_ids, decode = (lambda text: policy.prompt_ids([text])[0]), partial(trainer._tokenizer.decode,
                                                                               skip_special_tokens=True)
    backend = trainer.vllm_generation
    if backend.mode == "colocate":
        yield VLLMStream(backend, temperature, prompt_ids, decode, rollout_seed)
        return
    stream = ServerStream(request_client(trainer, concurrency), backend, temperature, prompt_ids, decode, concurrency,
                          rollout_seed, version=lambda: trainer._last_loaded_step)
    try:
        yield stream
    finally:
        stream.close()


def request_client(trainer, connections: int):
    """This process's client for a server's completions, with room for `connections` requests at once: one made
    once (TRL gives the main process alone one, for its weight syncs), on `ServerRequests` (a timeout on every
    request, few retries)."""
    client = getattr(trainer, "_request_client", None)
    if client is None:
        from trl.generation.vllm_client import VLLMClient

        backend = trainer.vllm_generation
        url = backend.server_base_url or f"http://{backend.server_host}:{backend.server_port}"
        client = trainer._request_client = VLLMClient(base_url=url, connection_timeout=backend.server_timeout)
    if getattr(client.session.get_adapter(client.base_url), "connections", 0) < connections:
        client.session.mount(client.base_url, ServerRequests(trainer.args.vllm_request_timeout, connections))
    return client


def trainer_rollout(trainer, envs, tasks: Sequence[Mapping[str, Any]], group_size: int, temperature: float,
                    description: str, rollout_seed: int | None = None) -> Rollout:
    """One rollout of the trainer's policy: every task played `group_size` times in `envs`. Lock-step: one generate
    call of `trainer_generator`'s per turn; with several processes every process joins every call (with dummy
    prompts when it has no live episode, or fewer than a backend that slices by position needs) until no process
    has a live episode. Continuous (`rollout_mode`): each episode on its own, colocated vLLM's requests one by one
    (`VLLMStream`) or transformers' generate on the prompts waiting (`PolicyStream`), no process waiting for
    another."""
    bar = progress_bar(total=trainer.args.max_env_steps, desc=description, unit="turn", leave=False,
                       dynamic_ncols=True, disabled=trainer.args.disable_tqdm or not trainer.accelerator.is_main_process)

    def on_turn(turn: int, live: int) -> None:
        bar.update(turn + 1 - bar.n)
        bar.set_postfix(live_episodes=live, refresh=False)

    def lockstep_count(count: int) -> int:
        by_position = slices_by_position(trainer.use_vllm, trainer.vllm_mode, trainer.vllm_tensor_parallel_size)
        return prompts_per_call(count, process_values(trainer.accelerator, count) if by_position else None)

    continuous = trainer.args.plays_continuously(trainer._env_workers)
    lockstep = trainer.accelerator.num_processes > 1 and not continuous
    with trainer_generator(trainer, temperature) as generate, bar:
        policy = ModelPolicy(trainer._tokenizer, generate, trainer.chat_template_kwargs,
                             call_size=lockstep_count if lockstep else None)
        if continuous:
            with completion_stream(trainer, policy, temperature, len(tasks) * group_size, rollout_seed) as stream:
                return run_continuous(envs, tasks, group_size, stream, trainer.rollout_settings, on_turn=on_turn,
                                      count_tokens=policy.count_tokens)
        return run_rollout(envs, tasks, group_size, policy, trainer.rollout_settings, on_turn=on_turn,
                           keep_going=(lambda live: any_process(trainer.accelerator, live > 0)) if lockstep else None,
                           count_tokens=policy.count_tokens)
