"""Evaluate a model (or a random / expert reference player) on an environment's evaluation splits, over seeds.

    python evaluate.py --config configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml --model_name_or_path outputs/run
    python evaluate.py --config configs/quickstart.yaml --model_name_or_path outputs/quickstart --greedy
    python evaluate.py --config configs/alfworld/hgpo_k4_qwen2.5-1.5b.yaml --policy random expert
    python evaluate.py --help
"""

# --help answers before the training stack is imported
from hgpo_trl.commands.entry_points import evaluate as main

if __name__ == "__main__":
    main()
