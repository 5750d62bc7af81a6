"""WebShop (Yao et al. 2022): a text shop where the agent searches, browses and buys what an instruction asks.

Modules: `catalogue` (products, goals, the generated catalogue), `original` (the original data files),
`search` (BM25), `shop` (a data source's products, index and goals, cached), `pages` (the text pages),
`reward` (the purchase score), `env` (the environment), `tasks` (the task lists), `prompt` (the prompt).
"""

from hgpo_trl.envs.webshop.env import WebShopEnv
from hgpo_trl.envs.webshop.tasks import webshop_tasks

__all__ = ["WebShopEnv", "webshop_tasks"]
