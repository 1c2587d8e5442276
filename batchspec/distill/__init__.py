"""batchspec distill: train a draft on the target's own outputs.

``batchspec.distill(spec, DistillOptions(out=..., draft=...))`` runs
:func:`batchspec.distill.session.distill`: the library's ``distill`` and this package share one
name, so the package itself is callable (a package is its parent's attribute of that name once
it is imported, whatever the parent set before)."""

from __future__ import annotations

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from batchspec.distill.session import distill

        return distill(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
