"""A constraint as llguidance's grammar text. Runs in the sandbox's children (sandbox_child.py), so it imports
nothing of pagedserve: converting a big grammar is seconds of Python (GBNF to Lark) that, in the engine's
process, would contend for the GIL with the step loop; and the text is not trusted until it compiled there.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared for type checkers only

# JSON is written as json.dumps writes it: one space after ',' and ':', no other whitespace. A model may not
# pad with newlines forever, and more positions admit exactly one token (jump-forward).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

# Thinking ahead of the answer: the `suffix` lexeme ends at the first </think> (a greedy regex would run past it).
_THOUGHT = 'thought[suffix="</think>"]: /(.|\n)*/'
_THINKING_LARK = {
    "optional": f'start: think? @answer\nthink: "<think>" thought /[ \\n]*/\n{_THOUGHT}',
    "opened": f"start: thought /[ \\n]*/ @answer\n{_THOUGHT}",
}


def grammar_text(kind: str, spec: str, thinking: str = "none") -> str:
    """A StructuredOutput's fields as an llguidance grammar; ValueError (the reason) when it is malformed."""
    answer = _answer_grammar(kind, spec)
    if thinking == "none":
        return answer
    grammars = json.loads(answer)["grammars"] if answer.startswith("{") else [{"lark_grammar": answer}]
    grammars[0] = {**grammars[0], "name": "answer"}
    return json.dumps({"grammars": [{"lark_grammar": _THINKING_LARK[thinking]}, *grammars]})


def _answer_grammar(kind: str, spec: str) -> str:
    """llguidance's grammar: a JSON TopLevelGrammar, or Lark text (choices and grammars)."""
    try:
        if kind == "json_schema":
            schema = json.loads(spec)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llguidance.grammar_from("choice", spec)
        return llguidance.grammar_from("grammar", spec)
    except (ValueError, TypeError, RuntimeError) as exc:  # the library's messages say what is wrong
        raise ValueError(str(exc)) from None
