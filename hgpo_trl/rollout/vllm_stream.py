"""vLLM as a `CompletionStream` (`hgpo_trl.rollout.continuous`), request by request. Colocated (`VLLMStream`): each
prompt is one request added to TRL's colocated engine (`LLMEngine.add_request`), and each `finished()` is one
engine step (`LLMEngine.step`), which hands back the requests that finished; vLLM's continuous batching fills the
batch with whatever is waiting. A server (`ServerStream`): each prompt one HTTP request, the server batching them.

The sampling settings are those TRL's `VLLMGeneration.generate` gives a colocated call (temperature, top-p/k,
min-p, repetition penalty, max_completion_length, logprobs, its generation_kwargs), plus a seed per request: drawn
from (a seed per rollout, from this process's seeded torch stream; the episode; the step), so that a request
samples the same tokens whatever it is batched with, as far as vLLM's batched arithmetic gives the same logits
(measured: docs/trainer.md), and a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from hgpo_trl.rollout.lockstep import Completion


def sampling_settings(backend, temperature: float) -> dict:
    """The sampling settings TRL's `VLLMGeneration.generate` asks vLLM for, at `temperature`: the arguments its server
    client and vLLM's SamplingParams share."""
    return {"n": 1, "repetition_penalty": backend.repetition_penalty, "temperature": temperature,
            "top_p": backend.top_p, "top_k": backend.top_k, "min_p": backend.min_p or 0.0,
            "max_tokens": backend.max_completion_length, "logprobs": backend.logprobs}


def sampling_kwargs(backend, temperature: float) -> dict:
    """SamplingParams' arguments as TRL's colocated generate builds them, at `temperature`."""
    kwargs = {**sampling_settings(backend, temperature), **backend.generation_kwargs}
    if backend.structured_outputs_regex is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(regex=backend.structured_outputs_regex)
    return kwargs


def sampled_logprobs(logprobs: list[list[list[float]]]) -> list[list[float]]:
    """One log-probability per completion token, the sampled token's, from TRL's vLLM answers (colocated or from a
    server: per token the sampled token's first, then any top-k)."""
    return [[token[0] for token in completion] for completion in logprobs]


def abort_unfinished(engine) -> None:
    """Abort every request that `engine` (vLLM's LLMEngine) still holds. A generate call that an exception ends
    (Ctrl-C during an engine step) leaves its requests in the engine, and the next call meets them: a `VLLMStream`
    outputs of request ids it never made (a KeyError), TRL's lock-step generate requests whose outputs were lost
    with the interrupted step, which it then waits for forever."""
    engine.abort_request(list(engine.output_processor.request_states), internal=True)


def draw_rollout_seed() -> int:
    """A rollout's seed from this process's generation stream (torch's, seeded by the run): where the caller gives
    none (evaluation; a training rollout's comes from its iteration)."""
    return int(torch.randint(0, 2**63 - 1, ()))


def request_seed(rollout_seed: int, episode: int, step: int) -> int:
    """A request's sampling seed: 32 bits of the SeedSequence of (rollout seed, episode, step)."""
    return int(np.random.SeedSequence((rollout_seed, episode, step)).generate_state(1)[0])


class VLLMStream:
    """Requests to `backend.llm` (TRL's colocated VLLMGeneration), one per prompt (see the module doc).
    `prompt_ids(text)` encodes a prompt as the lock-step policy does; `decode` turns completion ids into text."""

    def __init__(self, backend, temperature: float, prompt_ids: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], rollout_seed: int | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine = backend.llm.llm_engine
        self.prompt_ids, self.decode = prompt_ids, decode
        # skip_clone: each request's copy (ours for its seed, vLLM's own in add_request) is shallow, not deep: two
        # deep copies were a request's largest cost in a profile of the quickstart's rollout, and no field is changed.
        self._params = SamplingParams(**sampling_kwargs(backend, temperature), skip_clone=True,
                                      output_kind=RequestOutputKind.FINAL_ONLY)
        self._rollout_seed = draw_rollout_seed() if rollout_seed is None else rollout_seed
        self._keys: dict[str, int] = {}

    def submit(self, key: int, prompt: str, step: int) -> None:
        params = self._params.clone()
        params.seed = request_seed(self._rollout_seed, key, step)
        request = f"{self._rollout_seed}-{key}-{step}"
        self._keys[request] = key
        self.engine.add_request(request, {"prompt_token_ids": self.prompt_ids(prompt)}, params)

    def finished(self) -> list[tuple[int, Completion]]:
        from trl.generation.vllm_generation import extract_logprobs

        done = []
        for output in self.engine.step():
            if output.finished:
                ids = list(output.outputs[0].token_ids)
                logprobs, _ = extract_logprobs([output])
                done.append((self._keys.pop(output.request_id), Completion(
                    text=self.decode(ids), prompt_ids=list(output.prompt_token_ids), completion_ids=ids,
                    logprobs=None if logprobs is None else sampled_logprobs(logprobs)[0])))
        return done

    def abort(self) -> None:
        self.engine.abort_request(list(self._keys))
        self._keys.clear()


class ServerStream:
    """A vLLM server as a `CompletionStream`: each prompt one request to its completions API (TRL's `VLLMClient`
    `client`, one prompt a call), sent from a thread of a pool so that every waiting prompt is in the server's
    continuous batch; `finished()` waits for the first answer and returns all that have come. The sampling
    settings are TRL's server call's, plus a seed per request drawn as `VLLMStream` draws it. Several trainer
    processes each send their own requests: no process waits for another. Each completion records `version()`, the
    optimizer step of the server's weights when it was asked, and the request carries it as its prefix-cache salt:
    vLLM shares cached keys and values only between requests of one salt, so no request reuses a prompt's keys and
    values computed with older weights, while the requests that run across a weight push go on undisturbed (emptying
    the cache would preempt them and compute them again). Played ahead of the trainer (`hgpo_trl.rollout.ahead`),
    `finished()` raises `RolloutsStopped` once `stopped()`."""

    def __init__(self, client, backend, temperature: float, prompt_ids: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], concurrency: int, rollout_seed: int | None = None,
                 version: Callable[[], int | None] = lambda: None, stopped: Callable[[], bool] = lambda: False):
        from concurrent.futures import ThreadPoolExecutor

        self.client, self.prompt_ids, self.decode, self.version, self.stopped = \
            client, prompt_ids, decode, version, stopped
        self._settings = {**sampling_settings(backend, temperature),
                          "structured_outputs_regex": backend.structured_outputs_regex}
        self._generation_kwargs = backend.generation_kwargs or {}
        self._rollout_seed = draw_rollout_seed() if rollout_seed is None else rollout_seed
        self._pool = ThreadPoolExecutor(max_workers=max(concurrency, 1), thread_name_prefix="vllm-request")
        self._requests: dict = {}  # future -> episode key
        self._aborted = False

    def _complete(self, prompt_ids: list[int], seed: int, version: int | None) -> Completion:
        import requests

        try:
            salt = {} if version is None else {"cache_salt": f"weights-{version}"}
            answer = self.client.generate(prompts=[prompt_ids], **self._settings,
                                          generation_kwargs={**self._generation_kwargs, "seed": seed, **salt})
        except requests.ReadTimeout:
            raise RuntimeError(f"the vLLM server at {self.client.base_url} did not answer a request within "
                               f"{self.client.session.get_adapter(self.client.base_url).timeout[1]:g} s "
                               f"(vllm_request_timeout): is it hung, or overloaded?") from None
        except requests.RequestException as err:  # (after the retries of `ServerRequests`)
            raise RuntimeError(f"the vLLM server at {self.client.base_url} did not answer a request "
                               f"({type(err).__name__}): is it still running?") from None
        except Exception as err:  # TRL's client: "Request failed: <status>, <the server's answer>"
            raise RuntimeError(f"the vLLM server at {self.client.base_url} refused a request: {str(err)[:300]}") from None
        ids = list(answer["completion_ids"][0])
        logprobs = answer["logprobs"]
        return Completion(text=self.decode(ids), prompt_ids=list(answer["prompt_ids"][0]), completion_ids=ids,
                          logprobs=None if logprobs is None else sampled_logprobs(logprobs)[0], version=version)

    def submit(self, key: int, prompt: str, step: int) -> None:
        future = self._pool.submit(self._complete, self.prompt_ids(prompt), request_seed(self._rollout_seed, key, step),
                                   self.version())
        self._requests[future] = key

    def finished(self) -> list[tuple[int, Completion]]:
        from concurrent.futures import FIRST_COMPLETED, wait

        from hgpo_trl.rollout.ahead import RolloutsStopped

        done: set = set()
        while not done:
            if self.stopped():
                raise RolloutsStopped("the rollouts ahead were stopped")
            done, _ = wait(list(self._requests), timeout=STOP_POLL_SECONDS, return_when=FIRST_COMPLETED)
        return [(self._requests.pop(future), future.result()) for future in done]

    def abort(self) -> None:
        """Drop the requests not sent yet; those the server holds finish there, their answers unread (their threads
        are not waited for)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._requests.clear()
        self._aborted = True

    def close(self) -> None:
        self._pool.shutdown(wait=not self._aborted)


STOP_POLL_SECONDS = 0.5  # how often a stream waiting on a server looks whether its rollouts were stopped


class ServerRequests(HTTPAdapter):
    """requests' transport for a vLLM server's completions: each request answered within `timeout` seconds or failed
    (requests waits forever by default: a server that hangs would hang the run); a refused connection retried for
    ~6 s (a server restarting; TRL's client retries for a minute, so a dead server's line came that late), a read
    never (it would generate the completion twice); `connections` kept open, one per request in flight (TRL's client
    keeps 64 and warns above)."""

    def __init__(self, timeout: float, connections: int):
        super().__init__(pool_maxsize=connections, max_retries=Retry(
            total=CONNECT_RETRIES, connect=CONNECT_RETRIES, read=0, status=0, other=0, backoff_factor=1))
        self.timeout, self.connections = (CONNECT_SECONDS, timeout), connections

    def send(self, request, timeout=None, **kwargs):
        return super().send(request, timeout=self.timeout if timeout is None else timeout, **kwargs)


CONNECT_RETRIES = 3  # a refused connection is retried after 0, 2 and 4 s (urllib3's backoff, factor 1)
CONNECT_SECONDS = 10.0  # to open a connection (a host that drops packets would otherwise take minutes)
