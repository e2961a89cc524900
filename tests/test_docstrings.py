"""Every public function of the package taking three or more arguments documents them in an
``Args:`` section of its docstring (a method that overrides a documented one, from a base class of
the package or marked ``@override``, is documented there)."""
import ast
import pathlib

PACKAGE_FOLDERS = ("ext", "strategies", "triton_kernels", "recipes")
ROOT = pathlib.Path(__file__).resolve().parent.parent
LEAST_ARGUMENTS = 3


def _decorators(function: ast.FunctionDef) -> set[str]:
    names = set()
    for decorator in function.decorator_list:
        while isinstance(decorator, ast.Call):
            decorator = decorator.func
        names.add(decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", ""))
    return names


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "") for base in cls.bases]


def undocumented() -> list[str]:
    """`path:line name(arguments)` of each public function or method lacking its Args section."""
    classes: dict[str, ast.ClassDef] = {}
    functions: list[tuple[pathlib.Path, ast.FunctionDef, ast.ClassDef | None]] = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.FunctionDef):
                    functions.append((path, node, None))
                elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    classes[node.name] = node
                    functions += [(path, item, node) for item in node.body if isinstance(item, ast.FunctionDef)]

    def inherited(cls: ast.ClassDef, name: str) -> bool:
        for base in _base_names(cls):
            parent = classes.get(base)
            if parent is not None and (any(isinstance(item, ast.FunctionDef) and item.name == name
                                           for item in parent.body) or inherited(parent, name)):
                return True
        return False

    missing = []
    for path, function, cls in functions:
        if function.name.startswith("_") or "override" in _decorators(function):
            continue
        if cls is not None and inherited(cls, function.name):
            continue
        arguments = [a.arg for a in function.args.posonlyargs + function.args.args + function.args.kwonlyargs
                     if a.arg not in ("self", "cls")]
        if len(arguments) >= LEAST_ARGUMENTS and "Args:" not in (ast.get_docstring(function) or ""):
            missing.append(f"{path.relative_to(ROOT)}:{function.lineno} {function.name}({', '.join(arguments)})")
    return missing


def test_public_functions_document_their_arguments():
    assert undocumented() == []


def test_the_check_finds_an_undocumented_function(tmp_path, monkeypatch):
    package = tmp_path / "ext"
    package.mkdir()
    (package / "module.py").write_text(
        'class Base:\n'
        '    def act(self, a, b, c):\n'
        '        """Act.\n\n        Args:\n            a, b, c: what to act on.\n        """\n\n'
        'class Child(Base):\n'
        '    def act(self, a, b, c):\n'
        '        """Inherits its Args."""\n\n'
        'def documented(a, b, c):\n'
        '    """Do.\n\n    Args:\n        a, b, c: inputs.\n    """\n\n'
        'def two(a, b):\n'
        '    """Two arguments need no section."""\n\n'
        'def bare(a, b, *, c):\n'
        '    """No section."""\n')
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert undocumented() == ["ext/module.py:23 bare(a, b, c)"]
