"""Where the tiny preset's warm-ups are kept, so that every run that would build the same one reuses it.

A warm-up is determined by its settings (``WarmupConfig``: seed, task, steps, model, ...)
and by the code that trains it. Its cache directory is named by both::

    <cache root>/<task>-seed<seed>-<key>

where ``key`` hashes the settings, the source of every podsjax module the warm-up imports
and the versions of the libraries that compute it (jax, flax, optax, tokenizers,
transformers). So the quick start, its GRPO baseline, a comparison and a rerun share one
warm-up, and a change of any of these trains a new one instead of reusing a stale one.

The cache root is ``$PODSJAX_WARMUP_CACHE_DIR``, else ``$XDG_CACHE_HOME/podsjax/tiny_warmup``,
else ``~/.cache/podsjax/tiny_warmup``. Each entry is a small checkpoint (about 2 MB).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib

CACHE_ENV = "PODSJAX_WARMUP_CACHE_DIR"
# The libraries whose numerics or files the warm-up depends on.
_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "tokenizers", "transformers", "numpy")
_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]  # the podsjax package directory
_ENTRY = "podsjax.tiny.warmup"


def default_cache_root() -> str:
    """``$PODSJAX_WARMUP_CACHE_DIR``, else ``$XDG_CACHE_HOME/podsjax/tiny_warmup``, else
    ``~/.cache/podsjax/tiny_warmup``."""
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "podsjax", "tiny_warmup")


def cache_dir(config, root: str | os.PathLike | None = None) -> str:
    """The directory that holds (or will hold) the warm-up of ``config`` (a ``WarmupConfig``)."""
    root = os.fspath(root) if root is not None else default_cache_root()
    return os.path.join(root, f"{config.task}-seed{config.seed}-{cache_key(config)}")


def cache_key(config) -> str:
    """16 hex digits of a hash of ``config``'s settings and :func:`code_version`."""
    settings = json.dumps(config.to_json(), sort_keys=True)
    return hashlib.sha256(f"{settings}\n{code_version()}".encode()).hexdigest()[:16]


@functools.cache
def code_version() -> str:
    """A hash of the warm-up's code: the podsjax modules it imports (found by reading their
    import statements) and the versions of the libraries that compute it."""
    digest = hashlib.sha256()
    for name in _LIBRARIES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{name}={version}\n".encode())
    for path in sorted(_imported_files(_ENTRY)):
        digest.update(f"{path.relative_to(_PACKAGE_ROOT).as_posix()}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _module_file(name: str) -> pathlib.Path | None:
    """The source file of podsjax module ``name`` (a package's ``__init__.py``), or None."""
    parts = name.split(".")
    if parts[0] != "podsjax":
        return None
    base = _PACKAGE_ROOT.joinpath(*parts[1:])
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _imported_files(entry: str) -> set[pathlib.Path]:
    """Every podsjax source file ``entry`` imports, directly or not, with the packages' ``__init__``s."""
    seen: set[pathlib.Path] = set()
    pending = [entry]
    while pending:
        name = pending.pop()
        parts = name.split(".")
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        for depth in range(1, len(parts) + 1):
            path = _module_file(".".join(parts[:depth]))
            if path is None or path in seen:
                continue
            seen.add(path)
            pending += _imports_of(path, ".".join(parts[:depth]))
    return seen


def _imports_of(path: pathlib.Path, module: str) -> list[str]:
    """The podsjax modules ``path`` names in its import statements (``from m import x``: m, and
    m.x where x is a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names if _module_file(f"{base}.{alias.name}")]
    return [name for name in names if name.split(".")[0] == "podsjax"]
