"""A constraint after Qwen3's think block: the caller's grammar as the answer of a grammar that
lets the model reason first.

    optional   start: think? @answer          think: <think> REASONING </think> "\\n\\n"
    open       start: REASONING </think> "\\n\\n" @answer

`@answer` is the constraint's own grammar (JSON schema, regex, Lark... as compiler.grammar_text
writes it), unchanged, as a nested grammar of llguidance's top-level format: its lexer, its
JSON options and its end are its own, and the think block is the same for every kind.
`<think>` and `</think>` are single tokens of Qwen3's vocabulary, named bare (llguidance matches
a special token only by name). REASONING is any text but the tags spelled out in pieces: the
frontend splits the reasoning off the text (services/frontend/reasoning.py), where a spelled
`</think>` would read as the block's end while the grammar still took it as reasoning.

Pure: builds grammar text; compiler.py compiles it.
"""

from __future__ import annotations

import json
from typing import Any

from mili.engine.constraint.spec import ThinkBlock

# What follows `</think>` before the answer: Qwen3's own (the frontend drops exactly this).
SEPARATOR = "\n\n"
_REASONING = r"REASONING: /(.|\n)*/ & ~/(.|\n)*<\/?think>(.|\n)*/"
_CLOSE = f"</think> {json.dumps(SEPARATOR)}"
_STARTS: dict[str, str] = {
    "optional": f"start: think? @answer\nthink: <think> REASONING {_CLOSE}\n{_REASONING}\n",
    "open": f"start: REASONING {_CLOSE} @answer\n{_REASONING}\n",
}
_ANSWER = "answer"
# The shortest text each shape lets the model write before the answer: where the constraint's
# own grammar starts (compiler.build checks that start as it checks a bare grammar's).
_SHORTEST: dict[str, str] = {
    "none": "",
    "optional": f"<think></think>{SEPARATOR}",
    "open": f"</think>{SEPARATOR}",
}


def after_think(grammar: str, think: ThinkBlock) -> str:
    """`grammar` (llguidance's top-level JSON, or Lark text) behind the think block `think`
    asks for; as it is for "none"."""
    if think == "none":
        return grammar
    grammars: list[dict[str, Any]]
    if grammar.lstrip().startswith("{"):
        grammars = [dict(g) for g in json.loads(grammar)["grammars"]]
    else:
        grammars = [{"lark_grammar": grammar}]
    grammars[0]["name"] = _ANSWER  # the top of the constraint's own (compiler.py writes one)
    top = {"name": "start", "lark_grammar": _STARTS[think]}
    return json.dumps({"grammars": [top, *grammars]})


def shortest_block(think: ThinkBlock) -> str:
    """The shortest text `think` allows before the answer ("" for "none"), tags as Qwen3's
    single tokens: past it, a matcher of `after_think`'s grammar is at the answer's start."""
    return _SHORTEST[think]
