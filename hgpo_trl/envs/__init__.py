"""Text environments for multi-turn agent RL: the `TextEnv` protocol, a registry, and the environments.

Import them as `hgpo_trl.envs` (`from hgpo_trl.envs import make_env, make_tasks, register_env`). Their modules
live in the repository's top-level `envs/` folder, the project's layout; a wheel installs them here, beside this
file, and a source checkout (or the editable install, which adds the checkout to `sys.path`) finds them there.
"""

from pathlib import Path

if not (Path(__file__).parent / "base.py").is_file():
    __path__.append(str(Path(__file__).resolve().parents[2] / "envs"))

from hgpo_trl.envs.alfworld import AlfWorldEnv, alfworld_tasks
from hgpo_trl.envs.base import Info, TextEnv
from hgpo_trl.envs.gymnasium_env import GymnasiumEnv, gymnasium_tasks
from hgpo_trl.envs.keydoor import KeyDoorEnv, keydoor_tasks
from hgpo_trl.envs.openenv_env import OpenEnvEnv, openenv_tasks
from hgpo_trl.envs.registry import is_fast_env, make_env, make_tasks, register_env, registered_envs
from hgpo_trl.envs.textarena_env import TextArenaEnv, textarena_tasks
from hgpo_trl.envs.trl_env import TRLEnv, trainer_environment, trl_tasks
from hgpo_trl.envs.webshop import WebShopEnv, webshop_tasks

__all__ = ["Info", "TRLEnv", "TextEnv", "is_fast_env", "make_env", "make_tasks", "register_env", "registered_envs",
           "trainer_environment"]

register_env("keydoor", KeyDoorEnv, keydoor_tasks, fast=True)
# invalid_tail_chars as released (env_package/{alfworld,webshop}/projection.py).
register_env("alfworld", AlfWorldEnv, alfworld_tasks, prompt_has_format=True, invalid_tail_chars=30)  # 0.1 s a step, 2-3 s a new game
register_env("webshop", WebShopEnv, webshop_tasks, fast=True, prompt_has_format=True,
             invalid_tail_chars=20)  # generated shop: ~0.2 ms a step
# Optional packages (extras textarena / gymnasium), imported when an environment is built. A fraction of a
# millisecond a step for the games tried; one with a slow reset (Sokoban, RushHour) can be given env_workers.
register_env("textarena", TextArenaEnv, textarena_tasks, fast=True)
register_env("gymnasium", GymnasiumEnv, gymnasium_tasks, fast=True)
# TRL's environment_factory classes (env_kwargs environment_factory: module:Class), stepped in process as TRL does.
register_env("trl", TRLEnv, trl_tasks, fast=True)
# OpenEnv environments (extra openenv): in process, or a client of a server on this machine (its own timeouts).
register_env("openenv", OpenEnvEnv, openenv_tasks, fast=True)
