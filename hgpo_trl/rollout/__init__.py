"""The rollout: tasks drawn (`sampler`), each played G times in its environments, lock-step (`lockstep`) or each
episode on its own (`continuous`), with memory-window prompts (`memory`), actions read from completions
(`actions`), the engines that generate (`generation`; colocated vLLM's request stream `vllm_stream`; vLLM's CPU
build `vllm_cpu`) and what an episode came to (`outcomes`). Nothing here knows about advantages or training."""

from typing import Any


def __getattr__(name: str) -> Any:  # the names of the module hgpo_trl.rollout was until 0.1 (hgpo_trl/moved.py)
    from hgpo_trl.moved import old_name

    return old_name("rollout", name)
