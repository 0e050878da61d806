"""The registry's declarations are checked when it is imported: under PP an
architecture may list only speculative methods whose draft shares the embedding."""

import inspect
import types

import pytest

from atom.models import registry

DECLARED = '"KimiLinearForCausalLM": frozenset({"dspark"}),'


def import_registry_declaring(method: str) -> types.ModuleType:
    """A fresh copy of the registry module whose Kimi Linear entry also lists
    `method`, imported (executed) the way Python imports the real one."""
    source = inspect.getsource(registry)
    assert DECLARED in source
    declared = f'"KimiLinearForCausalLM": frozenset({{"dspark", "{method}"}}),'
    module = types.ModuleType("registry_copy")
    code = compile(source.replace(DECLARED, declared), registry.__file__, "exec")
    exec(code, module.__dict__)
    return module


def test_the_unchanged_declarations_import():
    assert import_registry_declaring("dspark").pp_speculative_methods == (
        registry.pp_speculative_methods
    )


def test_importing_a_declaration_of_an_unknown_method_fails():
    with pytest.raises(TypeError, match="'medusa', whose draft keeps its own"):
        import_registry_declaring("medusa")


@pytest.mark.parametrize("shares", [False, None])
def test_the_check_refuses_a_method_that_keeps_its_embedding(monkeypatch, shares):
    if shares is not None:
        monkeypatch.setitem(registry.METHOD_SHARES_EMBEDDING, "medusa", shares)
    monkeypatch.setitem(registry.pp_speculative_methods, "Arch", frozenset({"medusa"}))
    with pytest.raises(TypeError, match=r"pp_speculative_methods\['Arch'\]"):
        registry._check_declarations()
