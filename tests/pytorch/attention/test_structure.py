"""Structure rules of issue 15 that a reader should not have to re-check by hand: short
functions, one home per name (no re-export shims), one immutable prepared call."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "transformer_engine"
DPA = "transformer_engine.pytorch.attention.dot_product_attention"
MAX_BODY_LINES = 60


def _body_lines(node: ast.FunctionDef) -> int:
    """Lines from the first statement after the signature and docstring to the end: TE's long
    signatures (DotProductAttention.forward's 25 arguments) are TE's, not ours to shorten."""
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def _long_functions(source: str, name: str):
    return [(f"{name}:{node.lineno} {node.name}", _body_lines(node)) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > MAX_BODY_LINES]


def test_no_function_body_passes_sixty_lines():
    long = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _long_functions(path.read_text(), str(path.relative_to(ROOT)))]
    assert long == [], f"functions over {MAX_BODY_LINES} lines (split them): {long}"


def test_the_line_count_counts_the_body_not_the_signature_or_docstring():
    signature = "def f(\n" + "".join(f"    a{i}=None,\n" for i in range(80)) + "):\n"
    short = signature + '    """Doc.\n\n    More.\n    """\n' + "    x = 1\n" * 60
    assert _long_functions(short, "m") == []
    assert _long_functions(short + "    return x\n", "m") == [("m:1 f", 61)]


@pytest.mark.parametrize("module", [f"{DPA}.gpu_ops", f"{DPA}._reexport"])
def test_old_module_paths_are_gone(module):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)


def test_utils_holds_only_te_names_and_backends_no_private_ones():
    utils = importlib.import_module(f"{DPA}.utils")
    public = {n for n in vars(utils) if not n.startswith("__")}
    assert public == {"AttentionLogging", "AttentionParams", "get_attention_backend", "get_qkv_layout"}
    backends = importlib.import_module(f"{DPA}.backends")
    private = {n for n, v in vars(backends).items() if n.startswith("_") and not n.startswith("__") and not isinstance(v, type(utils))}
    assert private == set()


def test_attention_inputs_is_one_frozen_record_without_extras():
    from transformer_engine.pytorch.attention.dot_product_attention.prepare.inputs import AttentionInputs

    assert AttentionInputs.__dataclass_params__.frozen
    names = {f.name for f in dataclasses.fields(AttentionInputs)}
    assert "extras" not in names and "bias_shape" in names and "max_logit" not in names
