"""Not a package: hands ``import podsjax`` to the installed package when this folder is named podsjax.

From the directory above a clone named ``podsjax``, Python finds this folder first and,
without this file, takes it for a namespace package: ``podsjax.data`` is then the
top-level ``data/`` folder, and ``from podsjax.data import Example`` fails. With this
file, that import runs here and loads the real package instead: the installed one (an
editable install's finder or site-packages), else the ``podsjax/`` folder below.
"""

if __name__ == "podsjax":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    def _real_spec():
        here = _os.path.dirname(_os.path.abspath(__file__))
        above = _os.path.dirname(here)
        # The path without the directory this folder was found in, so that the search cannot find it again.
        path = [entry for entry in _sys.path if _os.path.abspath(entry or _os.curdir) != above]
        for finder in _sys.meta_path:
            if finder is _machinery.PathFinder:
                spec = _machinery.PathFinder.find_spec(__name__, path)
            else:
                find = getattr(finder, "find_spec", None)
                spec = find(__name__, None) if find is not None else None
            if spec is not None and spec.origin not in (None, __file__) and spec.loader is not None:
                return spec
        inner = _os.path.join(here, "podsjax")
        return _util.spec_from_file_location(__name__, _os.path.join(inner, "__init__.py"),
                                             submodule_search_locations=[inner])

    _spec = _real_spec()
    _module = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _module  # the import statement returns what sys.modules holds
    _spec.loader.exec_module(_module)
