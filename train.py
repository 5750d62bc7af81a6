"""Train an LLM agent with HGPO (or GRPO / GiGPO / ProGPO) on a text environment.

    python train.py --config configs/quickstart.yaml   # one process: no launcher (it would kill a Ctrl-C's stop in 5 s)
    ALFWORLD_DATA=/path/to/alfworld python train.py --config configs/alfworld/tiny_cpu.yaml   # ALFWorld on a CPU
    accelerate launch --config_file configs/accelerate/paper_1.5b_2gpu.yaml train.py --config configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml
    python train.py --help
"""

# --help answers before the training stack is imported
from hgpo_trl.commands.entry_points import train as main

if __name__ == "__main__":
    main()
