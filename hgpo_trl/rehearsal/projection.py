"""What the real run needs, projected from the rehearsal's measurements and the real model's shape: GPU memory per
device by part, host memory per machine (loading the model, and DeepSpeed's offloads), and a lower bound on an
iteration's GPU time.

An estimate with stated assumptions, not a measurement (no GPU ever ran this). Per parameter (N of them; N_t
trainable, all of them without LoRA), on each of the P data-parallel processes:

| part | plain DDP | DeepSpeed ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 |
|---|---|---|---|---|---|
| weights | `dtype` bytes, + 2 for bf16 autocast's cast copies | 2 (bf16; 4 in fp32) | same | same | 2 / P, + the gathered working set |
| gradients | 2 x `dtype` bytes x N_t (and DDP's buckets) | (2 + 4) x N_t (bf16, and each cast to fp32) | (2 + 4 / P) x N_t (bf16, fp32 partition) | (2 + 4) x N_t / P | same |
| optimizer | 8 x N_t (AdamW moments) | 12 x N_t (fp32 master + moments) | 12 x N_t / P | same | same |
| KL reference | `dtype` bytes (none with LoRA) | 2 (bf16) | 2 | 2 | 2 / P |

DeepSpeed in bf16 as it does it (0.19.8, the venv's), `data_types.grad_accum_dtype` unset as accelerate's files
leave it (the model's dtype then: `DeepSpeedEngine.get_data_types`): at stage 0, `_do_optimizer_sanity_check`
(runtime/engine.py) answers DDP_BFLOAT16, which `_configure_fp16_optimizer` wraps in `FP16_UnfusedOptimizer`
(TRL's torch AdamW) or `FP16_Optimizer` (DeepSpeed's FusedAdam; runtime/fp16/): an fp32 copy of every trainable
weight, and every bf16 gradient cast to fp32 for the step, on every process. From stage 1 it is
`DeepSpeedZeroOptimizer` (runtime/zero/stage_1_and_2.py: `single_partition_of_fp32_groups`, the gradients cast
partition by partition) or stage 3's (runtime/zero/stage3.py: `fp32_partitioned_groups_flat`): 1 / P of both.
(`BF16_Optimizer`, runtime/bf16_optimizer.py, whose fp32 gradient buffers hold every weight's, is taken at
stage 1 only with `grad_accum_dtype: fp32`: not modelled.)

`offload_optimizer_device: cpu` moves the optimizer states and an fp32 copy of the gradients (4 x N_t / P) to host
memory; `offload_param_device: cpu` (ZeRO-3) the weight and reference partitions, leaving the gathered working
set on the GPU (two layers and the largest matrix, the embedding). Colocated vLLM holds `vllm_gpu_memory_utilization` of the GPU (weights and KV cache) unless
`vllm_enable_sleep_mode` frees it while training.

Host memory per machine peaks at one of two times, which never overlap (DeepSpeed moves the loaded weights to the
GPU before it allocates what it offloads): the offloads above, or loading, when every process builds its model on
the CPU in `dtype` (hgpo_trl/commands/train.py `load_model`), whole, or its 1 / P partition under ZeRO-3's zero.Init
(accelerate's `zero3_init_flag`, on by default at stage 3; a warm start loads it whole); under DeepSpeed the
policy waits there for `deepspeed.initialize` while TRL loads the KL reference beside it (transformers' Trainer
moves a plain DDP policy to its GPU first: `place_model_on_device`). Not counted: each process's libraries and
CUDA context, and the environment workers. Activations are those of one micro-batch (only one is alive),
padded to its longest row: per token, the structural count of `layer_elements_per_token` times a factor
calibrated on `benchmarks/scale.py`'s measurement (Qwen2.5-0.5B shape, float32, 4 rows of 439 + 64 tokens,
checkpointing off; docs/results.md); TRL's fused LM head adds its tile buffers, never the whole logits. A CUDA
context and allocator reserve of `RUNTIME_GIB` comes on top.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from hgpo_trl.rehearsal.shapes import SHAPES, ModelShape

GIB = 2**30
RUNTIME_GIB = 2.0  # CUDA context, NCCL buffers, the caching allocator's slack
# TRL's fused LM head (trl.kernels.chunked_logprob) never holds the logits: it projects at most 4,096 tokens at a
# time onto 32,768-row tiles of the vocabulary; one tile buffer forward and one backward.
HEAD_TOKENS, HEAD_ROWS = 4096, 32768
# benchmarks/scale.py, 2026-12-01 (docs/results.md): peak RSS minus the ~10 GiB of weights, gradients, AdamW
# states and the float32 reference, at Qwen2.5-0.5B's shape in float32, one micro-batch of 4 rows of 439 + 64
# tokens alive, gradient checkpointing off (on, the 2.4 GiB measured are mostly fixed-size temporaries at so
# small a micro-batch: not used).
SCALE_MEASURED = {"shape": "Qwen/Qwen2.5-0.5B-Instruct", "rows": 4, "tokens": 439 + 64, "activations_gib": 7.6}
SUSTAINED_TFLOPS = 400.0  # per GPU: ~40 % of an H100's dense bf16 peak (989 TFLOP/s), a good sustained rate


@dataclass(frozen=True)
class Placement:
    """Where the accelerate file puts the training state: DeepSpeed's ZeRO stage (0: plain DDP) and offloads."""

    processes: int
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    bf16: bool = True  # mixed precision bf16 (bf16 compute over `dtype` master weights)
    processes_per_machine: int | None = None  # None: all on one machine
    zero3_init: bool = True  # ZeRO-3 builds the model partitioned (accelerate's zero3_init_flag)
    deepspeed: bool | None = None  # None: DeepSpeed when zero_stage > 0 (a ZeRO-0 file says True)

    @property
    def uses_deepspeed(self) -> bool:
        return self.zero_stage > 0 if self.deepspeed is None else self.deepspeed


@dataclass(frozen=True)
class Workload:
    """The run's sizes that memory and time follow."""

    micro_batch: int  # per_device_train_batch_size
    prompt_tokens: float  # per row (a micro-batch is padded to its longest row)
    completion_tokens: float
    gradient_checkpointing: bool = True
    reference: bool = True  # beta != 0 (and no LoRA, whose reference is the base with the adapter off)
    trainable: int | None = None  # None: every parameter (no LoRA)
    weight_bytes: int = 4  # `dtype`: 4 float32, 2 bfloat16
    vllm_share: float = 0.0  # vllm_gpu_memory_utilization held through training (0: no vLLM, or sleep mode)
    warm_start: bool = False  # warmstart_steps > 0: the model loads whole, ZeRO-3 too


@dataclass
class MemoryProjection:
    gpu: dict[str, float]  # GiB per device, by part
    host: dict[str, float]  # GiB per machine, by part
    gpu_gib: float  # the device's size
    assumptions: list[str] = field(default_factory=list)
    load: float = 0.0  # GiB per machine while the processes load their models
    host_gib: float | None = None  # a machine's memory (None: unknown)

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def fits(self) -> bool:
        return self.gpu_total <= self.gpu_gib

    @property
    def host_need(self) -> float:
        """A machine's host memory at its peak: loading or the offloads (see the module docstring)."""
        return max(self.host_total, self.load)

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_gib is None else self.host_need <= self.host_gib


def layer_elements_per_token(shape: ModelShape, gradient_checkpointing: bool) -> int:
    """Activation elements a token keeps for backward: with checkpointing each layer's input plus one layer
    recomputed; without, every layer's (MLP: gate, up, activation, product; attention: norms, q/k/v, output,
    residuals)."""
    per_layer = 4 * shape.intermediate + 6 * shape.hidden + 2 * shape.heads * shape.head_dim \
        + 2 * shape.kv_heads * shape.head_dim
    return shape.layers * shape.hidden + per_layer if gradient_checkpointing else shape.layers * per_layer


def head_bytes(scored_tokens: float, element: int) -> float:
    """The fused LM head's tile buffers for `scored_tokens` positions."""
    return 2 * min(scored_tokens, HEAD_TOKENS) * HEAD_ROWS * element


def calibration() -> float:
    """Measured / structural activation bytes at scale.py's setting (CPU: every position scored, float32)."""
    shape, tokens = SHAPES[SCALE_MEASURED["shape"]], SCALE_MEASURED["rows"] * SCALE_MEASURED["tokens"]
    measured = SCALE_MEASURED["activations_gib"] * GIB - head_bytes(tokens, 4)
    return measured / (tokens * layer_elements_per_token(shape, gradient_checkpointing=False) * 4)


def activation_gib(shape: ModelShape, work: Workload, bf16: bool) -> tuple[float, float]:
    """(layers, LM head) GiB of one micro-batch; on a GPU the head scores the completion positions only."""
    element = 2 if bf16 else 4
    tokens = work.micro_batch * (work.prompt_tokens + work.completion_tokens)
    layers = tokens * layer_elements_per_token(shape, work.gradient_checkpointing) * element * calibration()
    return layers / GIB, head_bytes(work.micro_batch * work.completion_tokens, element) / GIB


def lora_parameters(shape: ModelShape, rank: int, targets: list[str] | str | None) -> int:
    """LoRA's trainable parameters: rank x (inputs + outputs) of each targeted projection of every layer (PEFT's
    default for Qwen: q_proj and v_proj; "all-linear": all seven; a string: a regular expression)."""
    q, kv, h, i = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.intermediate
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h, "gate_proj": h + i,
             "up_proj": h + i, "down_proj": i + h}
    if targets in ("all-linear", ["all-linear"]):
        names = list(sizes)
    elif isinstance(targets, str):  # PEFT matches a string as a regular expression on the module's full name
        names = [n for n in sizes if re.fullmatch(targets, f"model.layers.0.self_attn.{n}")
                 or re.fullmatch(targets, f"model.layers.0.mlp.{n}")]
    else:
        names = [n for n in (targets or ["q_proj", "v_proj"]) if n in sizes]
    return shape.layers * rank * sum(sizes[n] for n in names)


def project_memory(shape: ModelShape, place: Placement, work: Workload, gpu_gib: float = 80.0,
                   host_gib: float | None = None) -> MemoryProjection:
    """GPU memory per device and host memory per machine of the real run (see the module docstring)."""
    n, p = shape.parameters, place.processes
    trainable = n if work.trainable is None else work.trainable
    stage, deepspeed = place.zero_stage, place.uses_deepspeed
    compute = 2 if deepspeed and place.bf16 else work.weight_bytes  # DeepSpeed holds bf16 weights
    weights = n * compute + (2 * n if place.bf16 and not deepspeed and work.weight_bytes == 4 else 0)
    grads = trainable * compute * (2 if not deepspeed and p > 1 else 1)  # DDP: the gradients and its buckets
    master = trainable * 4 if deepspeed and place.bf16 else 0  # the gradients cast to fp32 (ZeRO: a partition)
    optimizer = trainable * (12 if deepspeed and place.bf16 else 8)
    reference = n * compute if work.reference else 0
    largest = shape.vocab_rows * shape.hidden * compute  # the embedding (and an untied LM head)
    layer = (n - shape.vocab_rows * shape.hidden * (1 if shape.tied else 2)) / shape.layers * compute
    host: dict[str, float] = {}
    per_machine = place.processes_per_machine or p
    if stage >= 1:
        optimizer, master = optimizer / p, master / p
    if stage >= 2:
        grads /= p
    if stage == 3:
        weights, reference = weights / p + 2 * layer + largest, reference / p  # + the gathered working set
    if place.offload_optimizer:
        host["optimizer states"] = optimizer * per_machine / GIB
        host["gradients (fp32)"] = 4 * trainable / p * per_machine / GIB
        optimizer, master = 0, 0
    if place.offload_param and stage == 3:
        host["weights"] = n * compute / p * per_machine / GIB
        host["KL reference"] = reference * per_machine / GIB
        weights, reference = 2 * layer + largest, 0
    whole = stage < 3 or not place.zero3_init or work.warm_start
    load = per_machine * (1 + (work.reference and deepspeed)) * n * work.weight_bytes / (1 if whole else p) / GIB
    layers, head = activation_gib(shape, work, place.bf16)
    gpu = {"weights": weights / GIB, "gradients": (grads + master) / GIB, "optimizer states": optimizer / GIB,
           "KL reference": reference / GIB, "vLLM": work.vllm_share * gpu_gib, "activations (layers)": layers,
           "activations (LM head)": head, "runtime": RUNTIME_GIB}
    assumptions = [
        f"{n / 1e9:.2f}B parameters ({shape.source})" + (f", {trainable / 1e6:.1f}M trainable" if trainable != n else ""),
        f"{'DeepSpeed ZeRO-' + str(stage) if deepspeed else 'plain DDP'} over {p} GPUs"
        + (", optimizer offloaded to CPU" if place.offload_optimizer else "")
        + (", parameters offloaded to CPU" if place.offload_param and stage == 3 else ""),
        f"one micro-batch of {work.micro_batch} rows x ({work.prompt_tokens:.0f} prompt + "
        f"{work.completion_tokens:.0f} completion tokens), gradient checkpointing "
        f"{'on' if work.gradient_checkpointing else 'off'}, layer activations x{calibration():.2f} "
        "(calibrated on benchmarks/scale.py)",
    ]
    return MemoryProjection(gpu=gpu, host=host, gpu_gib=gpu_gib, assumptions=assumptions, load=load,
                            host_gib=host_gib)


def verdict(projection: MemoryProjection, shape: ModelShape, place: Placement, work: Workload) -> str:
    """One line: fits, or by how much it does not and the fields whose change (each projected again) fits."""
    total, size = projection.gpu_total, projection.gpu_gib
    if projection.fits:
        return f"fits: {total:.1f} of {size:.0f} GiB per GPU ({size - total:.1f} GiB spare)"

    def fits(**change) -> bool:
        return project_memory(shape, place, dataclasses.replace(work, **change), size).fits

    fixes = [f"per_device_train_batch_size {rows}" for rows in range(work.micro_batch - 1, 0, -1)
             if fits(micro_batch=rows)][:1]
    if work.vllm_share:
        # vLLM needs its weights (bf16) and some KV cache inside its share
        floor = (2 * shape.parameters / GIB + 2.0) / size
        share = math.floor((work.vllm_share - (total - size) / size) * 100) / 100
        if share >= floor and fits(vllm_share=share):
            fixes.append(f"vllm_gpu_memory_utilization {share:.2f}")
        if fits(vllm_share=0.0):
            fixes.append("vllm_enable_sleep_mode: true")
    if not work.gradient_checkpointing and fits(gradient_checkpointing=True):
        fixes.append("gradient_checkpointing: true")
    hint = (f"; set {' or '.join(fixes)}" if fixes else
            "; no one field fits it: more GPUs, a higher ZeRO stage or CPU offload (an accelerate file)")
    return f"does not fit: {total:.1f} of {size:.0f} GiB per GPU, {total - size:.1f} GiB over{hint}"


def host_verdict(projection: MemoryProjection, shape: ModelShape, place: Placement, work: Workload) -> str:
    """One line: a machine's host memory at its peak against `host_gib`: fits, not checked, or by how much it does
    not and the changes (each projected again, the GPUs still fitting if they did) that fit."""
    need, size = projection.host_need, projection.host_gib
    peak = "loading" if projection.load > projection.host_total else "the offloads"
    if size is None:
        return (f"not checked: {need:.1f} GiB per machine at its peak ({peak}); give --host_memory_gib, the memory "
                "of one machine of the real run")
    if need <= size:
        return f"fits: {need:.1f} of {size:.0f} GiB per machine ({size - need:.1f} GiB spare)"
    replace = dataclasses.replace
    changes = [("dtype: bfloat16", place, replace(work, weight_bytes=2))] if work.weight_bytes > 2 else []
    if place.zero_stage == 3 and not place.zero3_init and not work.warm_start:
        changes.append(("zero3_init_flag: true (the accelerate file)", replace(place, zero3_init=True), work))
    if place.zero_stage == 3 and place.offload_param:
        changes.append(("offload_param_device: none (the accelerate file)", replace(place, offload_param=False), work))
    if place.offload_optimizer:
        changes.append(("offload_optimizer_device: none (the accelerate file)", replace(place, offload_optimizer=False),
                        work))
    fixes = [name for name, changed_place, changed_work in changes
             if (again := project_memory(shape, changed_place, changed_work, projection.gpu_gib, size)).host_fits
             and (again.fits or not projection.fits)]
    hint = (f"; set {' or '.join(fixes)}" if fixes else
            "; no one field fits it: a machine with more memory, or fewer processes on each (more machines)")
    return f"does not fit: {need:.1f} of {size:.0f} GiB per machine at its peak ({peak}), {need - size:.1f} GiB over{hint}"


@dataclass(frozen=True)
class IterationLoad:
    """What one iteration of the real run does, over all processes."""

    step_samples: float
    optimizer_steps: float
    generated_tokens: float  # completions (decode)
    prompt_tokens: float  # prompts (prefill)
    scored_tokens: float  # old / reference log-probability passes
    trained_tokens: float


def gpu_seconds_bound(shape: ModelShape, load: IterationLoad, gpus: int, tflops: float = SUSTAINED_TFLOPS,
                      gradient_checkpointing: bool = True) -> float:
    """A lower bound on the GPU time of an iteration of `load`: ~2 x N FLOPs a generated, prefilled or scored
    token, 6 x N a trained one (8 x N with checkpointing's recomputed forward), at `tflops` sustained per GPU. A
    bound, not a forecast: decoding is memory-bound, environments and the weight sync to vLLM come on top (the
    part of it a continuous rollout saves: environments hidden behind generation, no wait for a turn's longest
    completion; docs/trainer.md)."""
    n = shape.parameters
    flops = 2 * n * (load.generated_tokens + load.prompt_tokens + load.scored_tokens) \
        + (8 if gradient_checkpointing else 6) * n * load.trained_tokens
    return flops / (gpus * tflops * 1e12)
