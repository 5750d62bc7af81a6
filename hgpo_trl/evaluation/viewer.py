"""The trajectory viewer's page: trajectory dumps drawn as one self-contained HTML file (hgpo_trl/evaluation/viewer.html,
its script and style inline), which a browser opens from disk with no network.

The dumps travel as JSON inside `<script type="application/json">` elements, one per dump, parsed only when the
dump is chosen, so a page of several paper-sized dumps (16 x 8 episodes of up to 50 steps each) opens quickly;
every `<`, `>` and `&` is written as a JSON escape, so no text of a dump (a prompt holding `</script>`) can end
its element, and the page's script puts every text into the page as text, never as markup.
`hgpo_trl.evaluation.trajectories.to_html` prepares the dumps (`view_data`) and writes the file. The page's address
names what it shows (`trajectories.html#dump=iter_000010&episode=3&step=2`), so a link opens it again.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PAGE = Path(__file__).with_name("viewer.html")
DUMPS_MARK = "<!--DUMPS-->"


def script_json(value: Any) -> str:
    """`value` as JSON that is safe inside a `<script>` element: ASCII, with `<`, `>` and `&` escaped."""
    text = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(dumps: Sequence[Mapping[str, Any]]) -> str:
    """The page for `dumps`, each {"name", "summary", "episodes"} (`view_data`), oldest first. It opens on the
    newest training iteration's (one with advantages: an evaluation's has one episode a task, no groups and no
    advantages), else on the newest, unless its address names a dump."""
    meta = [{"name": d["name"], "summary": d["summary"],
             "training": any(st["advantage"] is not None for ep in d["episodes"] for st in ep["steps"])}
            for d in dumps]
    blocks = [f'<script type="application/json" id="meta">{script_json(meta)}</script>']
    blocks += [f'<script type="application/json" id="dump-{i}">{script_json({"episodes": d["episodes"]})}</script>'
               for i, d in enumerate(dumps)]
    return PAGE.read_text().replace(DUMPS_MARK, "\n".join(blocks), 1)


def inline(page: str, height: int = 700) -> str:
    """The page in an iframe, as a notebook cell shows it: `IPython.display.HTML(inline(page))`."""
    return f'<iframe srcdoc="{html.escape(page, quote=True)}" style="width:100%;height:{height}px;border:0"></iframe>'
