"""Kubernetes operator and budget controller for stallfree (kopf). Import it as `stallfree.operator`."""

# NOTE: this folder is named operator/ (DESIGN.md), so a Python started in the repository root with the
# current directory on sys.path (`python -m pytest`, `python -c ...`) would find it as the top-level module
# `operator` and shadow the standard library, breaking `collections` at start-up. When that happens we load
# the real standard-library module in our place. Imported as `stallfree.operator`, this block does nothing.
if __name__ == "operator":
    import os as _os  # already loaded by site; nothing here may import collections

    _path = _os.path.join(_os.path.dirname(_os.__file__), "operator.py")
    with open(_path, encoding="utf-8") as _f:
        exec(compile(_f.read(), _path, "exec"), globals())
    __file__ = _path
