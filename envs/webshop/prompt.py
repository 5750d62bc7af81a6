"""verl-agent's WebShop prompt (`agent_system/environments/prompts/webshop.py`, Apache-2.0: WEBSHOP_TEMPLATE
and WEBSHOP_TEMPLATE_NO_HIS), filled as its `WebshopEnvironmentManager.build_text_obs` fills it: the history
as "[Observation n: '...', Action n: '...']" lines, the admissible actions one per line, quoted."""

from __future__ import annotations

from collections.abc import Sequence

# Both released templates start and end with a newline; the first line ends "environment. " in the one
# without history, "environment." in the other.
_HEAD = "\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment.{space}\n"
_TASK = "Your task is to: {task}.\n"
_TAIL = ("Your admissible actions of the current situation are: \n[\n{actions}\n].\n\n"
         "Now it's your turn to take one action for the current step.\n"
         "You should first reason step-by-step about the current situation, then think carefully which "
         "admissible action best advances the shopping goal. This reasoning process MUST be enclosed within "
         "<think> </think> tags. \n"
         "Once you've finished your reasoning, you should choose an admissible action for current step and "
         "present it within <action> </action> tags.\n")
NO_HISTORY = _HEAD.format(space=" ") + _TASK + "Your current observation is: {observation}.\n" + _TAIL
WITH_HISTORY = (_HEAD.format(space="") + _TASK + "Prior to this step, you have already taken {step} step(s). Below are the most "
                "recent {shown} observations and the corresponding actions you took: {history}\n"
                "You are now at step {current} and your current observation is: {observation}.\n" + _TAIL)


def render_prompt(task: str, history: Sequence[tuple[str, str]], observation: str, admissible: Sequence[str],
                  step: int) -> str:
    """`step` is the number of steps taken; `history` the last (observation, action) pairs before it."""
    actions = "\n".join(f"'{action}'," for action in admissible)
    if not history:
        return NO_HISTORY.format(task=task, observation=observation, actions=actions)
    first = step - len(history) + 1
    lines = "\n".join(f"[Observation {first + i}: '{obs}', Action {first + i}: '{act}']"
                      for i, (obs, act) in enumerate(history))
    return WITH_HISTORY.format(task=task, step=step, shown=len(history), history=lines, current=step + 1,
                               observation=observation, actions=actions)
