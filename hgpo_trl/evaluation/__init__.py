"""Evaluation: the protocol (`protocol`: every validation task once, in chunks, shared among processes or per seed
and split), the trajectory dumps and their readers (`trajectories`) and the page that draws them (`viewer`)."""

from typing import Any


def __getattr__(name: str) -> Any:  # the names of the module hgpo_trl.evaluation was until 0.1 (hgpo_trl/moved.py)
    from hgpo_trl.moved import old_name

    return old_name("evaluation", name)
