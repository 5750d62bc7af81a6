"""The lab's environment: a key corridor whose observations hide, with a tunable probability, whether the key is held.

At the entrance the agent takes the key (next observation: "You hold the key.") or goes on without it. It then
walks a corridor of `length` sections, at each one going on or turning back (which ends the episode), to a door:
opening it with the key is the success (reward 10, as ALFWorld's); without the key, or turning back, ends with 0.
Nothing runs out with time (an episode ends only at the door or by turning back), so a state's value depends on
where the agent is and on whether it holds the key, never on the step count.

Two kinds of task share the start: in a *clear* task a key holder's corridor and door observations show the key
("... The key glints in your hand."); in a *hiding* task they read exactly as a key-less agent's. `inconsistency`,
the issue's knob, is the share of hiding tasks (each task group draws its kind). With none, every observation has
one history, so HGPO's levels, GiGPO's anchor groups and the whole-history oracle groups coincide (the control).
With hiding tasks, steps that share an observation have histories that change their value (10 with the key, 0
without), the context inconsistency HGPO's deeper levels are for; only "You hold the key." tells them apart, and
a level sees it only while it is within its last K observations. The knob changes the batch, not what a task
asks: every task has the same optimal policy (take the key, go on, open the door).

The policy reads what a memory-window prompt shows, `hgpo_trl.rollout.memory.Memory.window(H)` plus the current
observation, so the lab's policy conditions on exactly what an LLM's prompt would hold (less the template).
Everything is finite: `build(...)` enumerates the Markov states of agent and environment, (position, key, t,
window), with their transitions, from which rollouts are a table lookup and values an exact backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hgpo_trl.rollout.memory import Memory

SUCCESS_REWARD = 10.0
ENTRANCE, KEYROOM, DOOR = "entrance", "keyroom", "door"
GO, TAKE, BACK, OPEN = "go on", "take key", "turn back", "open door"
GLINT = " The key glints in your hand."


def observation(position: str, section: int, shows_key: bool) -> str:
    if position == ENTRANCE:
        return "You are at the entrance. A key lies on a table."
    if position == KEYROOM:
        return "You hold the key."
    text = f"Corridor, section {section}." if position != DOOR else "A closed door."
    return text + GLINT if shows_key else text


def admissible(position: str) -> tuple[str, ...]:
    return {ENTRANCE: (TAKE, GO), KEYROOM: (GO,), DOOR: (OPEN, BACK)}.get(position, (GO, BACK))


@dataclass(frozen=True)
class Corridor:
    """The Markov chain of (task kind, environment state, memory window) under any policy over windows.

    Node 0 is the clear task's entrance, node 1 the hiding task's. Per node (a state at step t): `obs` its
    observation id, `context` the id of what the policy sees (window + observation), `aliased` whether it is a
    hiding task's node whose observation that task reaches both with and without the key (groups never span task
    groups, so a clear task's steps are never mixed with a hiding task's). Per (node, action slot a in 0..1): `allowed`, `reward`,
    `success`, `done` (the episode ends) and `child`."""

    history_length: int
    length: int
    step: np.ndarray  # (nodes,)
    obs: np.ndarray
    context: np.ndarray
    has_key: np.ndarray
    hiding: np.ndarray
    aliased: np.ndarray
    allowed: np.ndarray  # (nodes, 2)
    reward: np.ndarray
    success: np.ndarray
    done: np.ndarray
    child: np.ndarray
    observations: tuple[str, ...]  # text of each observation id
    contexts: tuple[tuple, ...]  # what the policy sees in each context id: (window pairs, observation)
    actions: tuple[tuple[str, ...], ...]  # per node: the admissible action texts, in slot order

    @cached_property
    def texts(self) -> np.ndarray:
        """Per node: its observation text (an object array, for StepBatch.obs)."""
        return np.array(self.observations, dtype=object)[self.obs]

    @cached_property
    def action_texts(self) -> np.ndarray:
        """(nodes, 2): the text of each action slot ("" where the node has no such slot)."""
        return np.array([(*names, "")[:2] for names in self.actions], dtype=object)

    @property
    def max_steps(self) -> int:
        """The longest episode: entrance, key, the sections, the door."""
        return self.length + 3

    @property
    def nodes(self) -> int:
        return self.step.size

    @property
    def num_contexts(self) -> int:
        return len(self.contexts)


def build(history_length: int = 2, length: int = 4) -> Corridor:
    """Enumerate the corridor's Markov states breadth first from the two entrances (nodes 0 and 1)."""
    if history_length < 0 or length < 1:
        raise ValueError(f"need history_length >= 0 and length >= 1, got {history_length} and {length}")
    obs_ids: dict[str, int] = {}
    context_ids: dict[tuple, int] = {}
    index: dict[tuple, int] = {}
    nodes: list[tuple] = []  # (position, section, key, hiding, t, window pairs, observation text)
    edges: list[list[tuple]] = []

    def node_id(position, section, key, hiding, t, memory: Memory) -> int:
        text = observation(position, section, key and not hiding)
        state = (position, section, key, hiding, t, tuple(memory.window(history_length)), text)
        if state not in index:
            index[state] = len(nodes)
            nodes.append(state)
        return index[state]

    for hiding in (False, True):
        node_id(ENTRANCE, 0, False, hiding, 0, Memory())
    frontier = 0
    while frontier < len(nodes):
        position, section, key, hiding, t, window, text = nodes[frontier]
        frontier += 1
        slots = []
        for action in admissible(position):
            memory = Memory([*window, (text, action)])
            reward, success, terminated, nxt = 0.0, False, False, None
            if position == ENTRANCE:
                nxt = (KEYROOM, 0, True) if action == TAKE else ("corridor", 1, False)
            elif position == KEYROOM:
                nxt = ("corridor", 1, True)
            elif action == BACK:
                terminated = True
            elif position == DOOR:
                terminated, success = True, key
                reward = SUCCESS_REWARD if success else 0.0
            else:
                nxt = (DOOR, 0, key) if section == length else ("corridor", section + 1, key)
            child = -1 if terminated else node_id(*nxt, hiding, t + 1, memory)
            slots.append((reward, success, terminated, child))
        edges.append(slots)

    n = len(nodes)
    obs = np.array([obs_ids.setdefault(s[6], len(obs_ids)) for s in nodes], dtype=np.int64)
    has_key = np.array([s[2] for s in nodes])
    hiding = np.array([s[3] for s in nodes])
    keys_of_obs = [set() for _ in obs_ids]  # groups never span task groups, so only a hiding task aliases
    for o, key in zip(obs[hiding], has_key[hiding], strict=True):
        keys_of_obs[o].add(bool(key))
    allowed, done = np.zeros((n, 2), dtype=bool), np.ones((n, 2), dtype=bool)
    reward, success, child = np.zeros((n, 2)), np.zeros((n, 2), dtype=bool), np.zeros((n, 2), dtype=np.int64)
    for i, slots in enumerate(edges):
        for a, (r, s, d, c) in enumerate(slots):
            allowed[i, a], reward[i, a], success[i, a], done[i, a], child[i, a] = True, r, s, d, max(c, 0)
    return Corridor(history_length=history_length, length=length, step=np.array([s[4] for s in nodes]), obs=obs,
                    context=np.array([context_ids.setdefault((s[5], s[6]), len(context_ids)) for s in nodes]),
                    has_key=has_key, hiding=hiding, aliased=hiding & np.array([len(keys_of_obs[o]) > 1 for o in obs]),
                    allowed=allowed, reward=reward,
                    success=success, done=done, child=child, observations=tuple(obs_ids),
                    contexts=tuple(context_ids), actions=tuple(admissible(s[0]) for s in nodes))


def policy_probabilities(corridor: Corridor, logits: np.ndarray) -> np.ndarray:
    """(seeds, nodes, 2) action probabilities of a softmax policy with `logits` (seeds, contexts, 2) over what
    each node's prompt shows; a slot the node does not admit has probability 0."""
    z = np.where(corridor.allowed, logits[:, corridor.context], -np.inf)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


@dataclass(frozen=True)
class Values:
    """Exact quantities of every node under a policy, per seed: V (discounted return to go), Q per action slot,
    and the success probability from the node on."""

    v: np.ndarray  # (seeds, nodes)
    q: np.ndarray  # (seeds, nodes, 2)
    success: np.ndarray  # (seeds, nodes)

    def advantage(self) -> np.ndarray:
        return self.q - self.v[..., None]


def exact_values(corridor: Corridor, probabilities: np.ndarray, gamma: float) -> Values:
    """Backward over steps: `Q(n, a) = r + gamma * V(child)` (0 after the last step) and
    `V(n) = sum_a pi(a | n) Q(n, a)`; the success probability likewise, undiscounted."""
    seeds = probabilities.shape[0]
    v, q = np.zeros((seeds, corridor.nodes)), np.zeros((seeds, corridor.nodes, 2))
    success = np.zeros((seeds, corridor.nodes))
    live = ~corridor.done
    for t in range(int(corridor.step.max()), -1, -1):
        at = np.flatnonzero(corridor.step == t)
        children, on = corridor.child[at], live[at]
        q[:, at] = corridor.reward[at] + gamma * on * v[:, children]
        win = corridor.success[at] + on * success[:, children]
        v[:, at] = (probabilities[:, at] * q[:, at]).sum(axis=-1)
        success[:, at] = (probabilities[:, at] * win).sum(axis=-1)
    return Values(v=v, q=np.where(corridor.allowed, q, 0.0), success=success)
