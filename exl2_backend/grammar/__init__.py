"""Constrained output: JSON (any object or a JSON Schema), regular expressions, Lark grammars and fixed choices,
on llguidance (spec.py: the request's form; matcher.py: per-sequence state; mask.py: masks on logits)."""

from exl2_backend.grammar.spec import GRAMMAR_TYPES, compile_grammar, grammar_problem

__all__ = ["GRAMMAR_TYPES", "compile_grammar", "grammar_problem"]
