"""The estimator lab (issue 22): does HGPO make a policy learn faster than GiGPO, and when?

A tabular softmax policy over what a memory-window prompt shows learns a key corridor whose observations hide,
with a tunable probability, whether the key is held (`corridor`). Hundreds of seeds learn at once, their
advantages from the library's own estimators on one stacked `StepBatch` (`learn`); the sweep runs estimators x
inconsistency x group size x memory window (`sweep`) and reports curves, AUC, paired differences from GiGPO
and the advantages' bias against exact values (`stats`, `report`).

    python -m hgpo_trl.lab --quick        # seconds
    python -m hgpo_trl.lab                # the full sweep
"""
